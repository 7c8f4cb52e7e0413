"""kvctl's pins over shards (review, 2026-12-05): `pins add` is all or none (a shard's failure
left the other shards' pins for their TTL, ids never printed); `pins ls` filters pins on each
shard before its limit and pages (read leases of shard 0 hid every pin of the others)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.ctl import queries as q
from kvfabric.format.errors import Busy
from kvfabric.format.ids import GroupId
from kvfabric.proto import directory as m


class Shards(DirectoryRouter):
    """Two shards; shard 1 refuses pins with `busy` when `busy`; leases per shard in id order."""

    def __init__(self, leases: dict[int, list[m.LeaseInfo]], busy: bool = False) -> None:
        super().__init__(cast(Any, None))
        self.shards = 2
        self.leases = leases
        self.busy = busy
        self.unpinned: list[tuple[int, int]] = []

    async def known_shards(self) -> int:
        return 2

    def shard_of(self, raw: bytes) -> int:
        return raw[0] % 2

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any) -> Any:
        if isinstance(message, m.Pin):
            if self.busy and shard == 1:
                raise Busy("shard 1 is busy")
            return m.PinReply(epoch=1, pin_id=10 + shard, pinned_groups=len(message.groups), expires_ms=0)
        if isinstance(message, m.Unpin):
            self.unpinned.append((shard, message.pin_id))
            return m.PinReply(epoch=1, pin_id=message.pin_id, pinned_groups=0, expires_ms=0)
        assert isinstance(message, m.ListLeases)
        listed = [
            x
            for x in self.leases.get(shard, [])
            if x.lease_id > message.after and (x.is_pin or not message.pins_only)
        ]
        page = listed[: min(message.limit, 3)]  # pages of 3 at most
        more = len(listed) > len(page)
        return m.LeaseList(epoch=1, leases=page, next_after=page[-1].lease_id if more and page else 0)


def lease(i: int, pin: bool = False) -> m.LeaseInfo:
    return m.LeaseInfo(lease_id=i, holder_id="h", is_pin=pin, groups=1, expires_ms=0)


def test_a_pin_one_shard_refuses_removes_the_others() -> None:
    routed = Shards({}, busy=True)
    with pytest.raises(Busy):
        asyncio.run(q.pin(routed, "h", [GroupId(b"\x00" * 16), GroupId(b"\x01" * 16)], 1000, 1.0))
    assert routed.unpinned == [(0, 10)]
    whole = Shards({})
    made = asyncio.run(q.pin(whole, "h", [GroupId(b"\x00" * 16), GroupId(b"\x01" * 16)], 1000, 1.0))
    assert [(s, r.pin_id) for s, r in made] == [(0, 10), (1, 11)] and not whole.unpinned


def test_pins_are_listed_from_every_shard_past_read_leases_and_pages() -> None:
    routed = Shards({0: [lease(i) for i in range(1, 120)], 1: [lease(i, pin=True) for i in (5, 6, 7, 8)]})
    pins = asyncio.run(q.list_leases(routed, 100, 1.0, pins_only=True))
    assert [(x.shard, x.lease.lease_id) for x in pins] == [(1, 5), (1, 6), (1, 7), (1, 8)]
    every = asyncio.run(q.list_leases(routed, 10, 1.0))
    assert [x.lease.lease_id for x in every] == list(range(1, 11))

"""The prefetch shell against a sharded directory (no NATS): a hint's lookup goes to every shard
holding some of its chunks, the hit is the prefix every shard found, and each lease goes back to
the shard that granted it."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.core.prefetch import PrefetchConfig, PrefetchCore
from kvfabric.format.errors import Unavailable
from kvfabric.format.ids import GroupId
from kvfabric.prefetch import shell as shell_module
from kvfabric.prefetch.shell import PrefetchShell
from kvfabric.proto import directory as m
from kvfabric.proto import prefetch as p
from kvfabric.proto.shards import shard_of
from tests.unit.core.dirkit import groups

SHARDS = 4
NOW = 1_000_000


class FakeRouter(DirectoryRouter):
    """A known map of `SHARDS` shards; `ask` answers from `answer(shard, verb, message)`."""

    def __init__(self, answer: Any) -> None:
        super().__init__(cast(Any, None))
        self.shards = SHARDS
        self.answer = answer
        self.asked: list[tuple[int, str, msgspec.Struct]] = []

    async def refresh(self) -> None:
        raise AssertionError("the map is known")

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        self.asked.append((shard, verb, message))
        reply = self.answer(shard, verb, message)
        if isinstance(reply, Exception):
            raise reply
        return reply


def make_shell(router: FakeRouter | DirectoryRouter) -> PrefetchShell:
    shell = PrefetchShell(
        PrefetchCore(PrefetchConfig()),
        holder_id="prefetch-test",
        tick_ms=20,
        scan_ms=1000,
        resolving_max=4,
        hot_groups_per_event_max=8,
        request_timeout_s=1.0,
        copy_timeout_s=1.0,
    )
    shell._router = router
    return shell


async def add(shell: PrefetchShell, hint: p.PrefetchHint) -> msgspec.Struct:
    """`shell._add(hint)`, then the releases it queued (the leases no hint keeps: each by a task
    of its own, never awaited in the hint's reply path) run to their end."""
    try:
        return await shell._add(hint)
    finally:
        await asyncio.gather(*shell._releases)


def spread_prefix() -> list[GroupId]:
    """A prefix whose chunks 0 and 1 lie on two shards and a later chunk on a third."""
    for seed in range(100):
        raws = [g.group_id() for g in groups(6, seed=seed)]
        first, second = shard_of(raws[0], SHARDS), shard_of(raws[1], SHARDS)
        if first != second and {shard_of(r, SHARDS) for r in raws[2:]} - {first, second}:
            return raws
    raise AssertionError("no prefix spread over shards")


def location(raw: bytes) -> m.ObjectLocation:
    replica = m.Replica(segment_id="s1", incarnation=1, slot=0, slot_generation=1)
    return m.ObjectLocation(
        chunk_index=int.from_bytes(raw[54:58], "little"),
        member=m.Member(0, 0, 0),
        size_bytes=10,
        checksum=b"c" * 16,
        replicas=[replica],
    )


def test_one_lookup_per_shard_the_hit_is_the_common_prefix_and_leases_go_back_by_shard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shell_module, "now_ms", lambda: NOW)
    raws = spread_prefix()
    missing = 1  # chunk 1 is gone: the hit is chunk 0 alone
    lease_of = {s: 100 + s for s in range(SHARDS)}

    def answer(shard: int, verb: str, message: msgspec.Struct) -> Any:
        if verb == "lease_release":
            assert isinstance(message, m.LeaseRelease)
            assert message.shard == shard and message.lease_id == lease_of[shard]
            return m.LeaseReply(epoch=1, lease_id=message.lease_id, expires_ms=0)
        assert verb == "lookup" and isinstance(message, m.Lookup)
        assert all(shard_of(g, SHARDS) == shard for g in message.groups)
        found = []
        for g in message.groups:  # each shard folds its own chunks
            if g == raws[missing]:
                break
            found.append(g)
        return m.LookupReply(
            epoch=1,
            hit_chunks=len(found),
            lease_id=lease_of[shard] if found else 0,
            lease_expires_ms=NOW + 60_000,
            objects=[location(g) for g in found],
        )

    router = FakeRouter(answer)
    shell = make_shell(router)
    hint = p.PrefetchHint(
        hint_id="h1", tenant="t", groups=raws, target_segment="s2", deadline_ms=NOW + 60_000
    )
    reply = asyncio.run(add(shell, hint))
    assert isinstance(reply, p.HintReply) and reply.status == "accepted" and reply.objects_queued == missing
    lookups = [(s, msg) for s, verb, msg in router.asked if verb == "lookup"]
    assert sorted(s for s, _ in lookups) == sorted({shard_of(r, SHARDS) for r in raws})
    # The leases kept are those of shards holding a chunk of the hit; the others went back at once.
    kept = sorted(shell._leases[("t", "h1")])
    in_hit = {shard_of(r, SHARDS) for r in raws[:missing]}
    assert kept == sorted((s, lease_of[s]) for s in in_hit)
    beyond = {shard_of(r, SHARDS) for r in raws[missing + 1 :]} - in_hit - {shard_of(raws[missing], SHARDS)}
    released_early = {s for s, verb, _ in router.asked if verb == "lease_release"}
    assert beyond and released_early == beyond  # hit only beyond the prefix: of no use

    async def hint_ends() -> None:  # its leases go back off the ticker (`_release_ended`)
        shell.core.cancel_hint("h1", "t")
        await shell._release_ended()
        assert shell._releases
        await asyncio.gather(*shell._releases)

    asyncio.run(hint_ends())
    released = [(s, msg) for s, verb, msg in router.asked if verb == "lease_release"]
    assert {s for s, _ in released} >= in_hit and ("t", "h1") not in shell._leases


def failing_shard(bad: int) -> Any:
    """Every shard but `bad` holds the whole prefix and grants lease 7; `bad` is failing over."""

    def answer(shard: int, verb: str, message: msgspec.Struct) -> Any:
        if verb == "lease_release":
            assert isinstance(message, m.LeaseRelease)
            return m.LeaseReply(epoch=1, lease_id=message.lease_id, expires_ms=0)
        if shard == bad:
            return Unavailable("leader gone")
        assert isinstance(message, m.Lookup)
        return m.LookupReply(
            epoch=1,
            hit_chunks=len(message.groups),
            lease_id=7,
            lease_expires_ms=NOW + 60_000,
            objects=[location(g) for g in message.groups],
        )

    return answer


def test_a_failing_shard_holding_the_first_chunk_fails_the_hint_and_the_other_leases_go_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shell_module, "now_ms", lambda: NOW)
    raws = spread_prefix()
    bad = shard_of(raws[0], SHARDS)
    router = FakeRouter(failing_shard(bad))
    shell = make_shell(router)
    hint = p.PrefetchHint(
        hint_id="h1", tenant="t", groups=raws, target_segment="s2", deadline_ms=NOW + 60_000
    )
    with pytest.raises(Unavailable):
        asyncio.run(add(shell, hint))
    granted = {s for s, verb, _ in router.asked if verb == "lookup" and s != bad}
    released = {(s, msg.shard) for s, verb, msg in router.asked if isinstance(msg, m.LeaseRelease)}
    assert granted and released == {(s, s) for s in granted} and not shell._leases


def test_a_failing_shard_cuts_the_hint_at_its_first_chunk_as_in_the_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 26: one merge rule for the client and prefetch (`kvfabric.cluster.lookups`): the
    chunks before the failing shard's first one still hit and are prefetched."""
    monkeypatch.setattr(shell_module, "now_ms", lambda: NOW)
    raws = spread_prefix()
    bad = shard_of(raws[1], SHARDS)  # its first chunk is chunk 1 (chunk 0 lies elsewhere)
    router = FakeRouter(failing_shard(bad))
    shell = make_shell(router)
    hint = p.PrefetchHint(
        hint_id="h1", tenant="t", groups=raws, target_segment="s2", deadline_ms=NOW + 60_000
    )
    reply = asyncio.run(add(shell, hint))
    assert isinstance(reply, p.HintReply) and reply.status == "accepted" and reply.objects_queued == 1
    first = shard_of(raws[0], SHARDS)
    assert shell._leases[("t", "h1")] == [(first, 7)]  # the lease protecting chunk 0 is kept
    granted = {s for s, verb, _ in router.asked if verb == "lookup" and s != bad}
    released = {s for s, verb, _ in router.asked if verb == "lease_release"}
    assert released == granted - {first}  # the others protect nothing: given back at once

"""The follower's pulls (issue 20): at the stream's end a JetStream pull is answered as soon as
one event is there, so events a save apart cost one pull request each unless the follower lets
them gather (`EVENTS_LINGER_S` after a short batch). A fake subscription answers a pull the way
the server does there: with every event published so far, or the first one to come."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

from kvfabric.core.eviction import EvictionConfig, EvictionCore
from kvfabric.eviction_policy.shell import EVENTS_FETCH_MAX, EVENTS_LINGER_S, EvictionShell
from kvfabric.format.ids import ChainHash, Namespace
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode

NAMESPACE = Namespace(bytes(4) + b"A" * 16 + bytes(34))
EVENTS = 40


class TrickleSub:
    """Events published one a turn of the event loop (a writer far faster than the linger);
    `fetch` returns what is there, or waits for the next one."""

    def __init__(self) -> None:
        self.published: list[Any] = []
        self.taken = 0
        self.fetches = 0
        self.more = asyncio.Event()
        self.all_applied = asyncio.Event()  # the follower asks again after taking every event

    async def publish_all(self) -> None:
        for seq in range(1, EVENTS + 1):
            event = m.GroupsPublished(
                groups=[
                    m.GroupPublished(
                        group=ChainHash(seq.to_bytes(32, "little")),
                        chunk_index=0,
                        members=1,
                        namespace=NAMESPACE,
                        parent=ChainHash(b""),
                        placements=[m.SegmentBytes("s1", 10)],
                    )
                ]
            )
            meta = SimpleNamespace(sequence=SimpleNamespace(stream=seq))
            self.published.append(SimpleNamespace(data=encode(event), metadata=meta))
            self.more.set()
            await asyncio.sleep(0)

    async def fetch(self, batch: int = 1, timeout: float | None = 5) -> list[Any]:  # noqa: ASYNC109
        self.fetches += 1
        if self.taken == EVENTS:
            self.all_applied.set()
        while self.taken == len(self.published):
            self.more.clear()
            await asyncio.wait_for(self.more.wait(), timeout)
        got = self.published[self.taken : self.taken + batch]
        self.taken += len(got)
        return got


def test_events_a_save_apart_share_pulls_and_all_are_applied_in_order() -> None:
    async def run() -> tuple[int, int, int]:
        core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.5), {})
        shell = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
        shell.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1 << 20), 0)
        sub = TrickleSub()
        follower = asyncio.create_task(shell._read_events(sub, end_seq=0))
        await sub.publish_all()
        await asyncio.wait_for(sub.all_applied.wait(), 30)  # generous: a loaded VM
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        return sub.fetches, shell.last_seq, core.used_bytes("s1")

    fetches, last_seq, used = asyncio.run(run())
    assert last_seq == EVENTS and used == 10 * EVENTS  # every event applied, once
    # Without the linger, a pull about every event or two (20-40 here); with it, the first pull
    # takes the first event and the next one, EVENTS_LINGER_S later, all the rest.
    assert EVENTS_LINGER_S > 0 and EVENTS_FETCH_MAX > EVENTS
    assert fetches <= 4, fetches

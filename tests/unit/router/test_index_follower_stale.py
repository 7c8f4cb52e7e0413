"""A burst of `shard_started` markers (16 shards starting one at a time after a failover or a
cold start) makes the router's index follower list the directory once, not once per marker,
and the index answers throughout: before the listing, while it is taken and indexed (events
still applied to the view served) and after its swap. Until 2026-12-07 each marker made the
index answer nothing until its own listing was done (seconds at 400k groups)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import msgspec

from kvfabric.core.routing_index import ListedSegment, RoutingIndex
from kvfabric.format.errors import Unavailable
from kvfabric.format.ids import ChainHash, pack_group_key
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.runtime.deadline import cancel_and_wait
from tests.unit.router.test_index_follower_batches import DOMAIN, NAMESPACE, follower_of, published

SHARDS = 16
WAIT_S = 20.0  # generous: CI's loaded cores (each step takes milliseconds)


def key(i: int) -> bytes:
    return pack_group_key(DOMAIN, ChainHash(i.to_bytes(32, "little")))


def summary(i: int) -> m.GroupSummary:
    return m.GroupSummary(
        group=ChainHash(i.to_bytes(32, "little")),
        namespace=NAMESPACE,
        chunk_index=0,
        state="published",
        members=1,
        expected_members=1,
        objects=[
            m.ObjectLocation(
                chunk_index=0,
                member=m.Member(0, 0, 0),
                size_bytes=10,
                checksum=b"c" * 16,
                replicas=[m.Replica(segment_id="s1", incarnation=1, slot=1, slot_generation=1)],
            )
        ],
    )


class Stream:
    """The events stream: appended to by the test, read by pull subscriptions from a start."""

    def __init__(self) -> None:
        self.events: list[msgspec.Struct] = []
        self.starts: list[int] = []  # where each subscription began
        self.is_connected = True

    def jetstream(self, timeout: float) -> Any:
        return self

    async def stream_info(self, name: str) -> Any:
        return SimpleNamespace(state=SimpleNamespace(first_seq=1, last_seq=len(self.events)), created=None)

    async def pull_subscribe(self, *args: Any, config: Any, **kwargs: Any) -> Any:
        self.starts.append(config.opt_start_seq)
        return Sub(self, config.opt_start_seq)


class Sub:
    def __init__(self, stream: Stream, start: int) -> None:
        self.stream = stream
        self.next = start

    async def fetch(self, n: int, **_: float) -> Any:
        events = self.stream.events
        if self.next > len(events):
            await asyncio.sleep(0.002)
            raise TimeoutError  # (as nats-py's: nothing new within the fetch's wait)
        batch = []
        for seq in range(self.next, min(len(events), self.next + n - 1) + 1):
            meta = SimpleNamespace(sequence=SimpleNamespace(stream=seq), num_pending=len(events) - seq)
            batch.append(SimpleNamespace(data=encode(events[seq - 1]), metadata=meta))
        self.next += len(batch)
        return batch

    async def unsubscribe(self) -> None:
        return None


class Directory:
    """The shard map and the listing; each listing waits for the test to let it end."""

    def __init__(self) -> None:
        self.epochs = {s: 2 for s in range(SHARDS)}
        self.listings = 0
        self.release: list[asyncio.Event] = []
        self.groups: list[int] = []  # what a listing answers

    async def refresh(self) -> None:
        return None

    async def segments(self, timeout_s: float) -> m.SegmentList:
        info = m.SegmentInfo(
            segment_id="s1", incarnation=1, domain=m.FailureDomain(host="h"), up=True, draining=False,
            capacity_bytes=1, reserved_bytes=0, reported_used_bytes=0, last_heartbeat_ms=0, data_addr="",
        )  # fmt: skip
        return m.SegmentList(epoch=0, segments=[info])

    async def list_groups(self, query: m.ListGroups, timeout_s: float, pages_max: int) -> list[Any]:
        self.listings += 1
        self.release.append(asyncio.Event())
        answer = [summary(i) for i in self.groups]
        await self.release[-1].wait()
        return answer


def test_a_burst_of_shard_starts_lists_once_and_routes_are_served_throughout() -> None:
    index = RoutingIndex()
    index.resync([ListedSegment("s1", 1, True)], [], at_seq=0)
    stream, directory = Stream(), Directory()
    now = [1_000.0]  # the follower's clock (s): moved by the test only
    follower = follower_of(index)
    follower.nc = cast(Any, stream)
    follower.router = cast(Any, directory)
    follower.clock = lambda: now[0]
    follower._leaders_checked_s = now[0]
    follower._listed_epochs = dict(directory.epochs)
    # Groups 0 and 1; the old core of shard 0 evicts group 0 but stops before publishing it.
    stream.events.append(published(0, 2, "s1"))
    directory.groups = [1, 3]  # what the directory holds (3: adopted by a rebuild, no event)
    blank: list[str] = []  # every turn of the loop: was group 1 counted?

    async def watch() -> None:
        while True:
            if not index.synced or not index.available_run([key(1)], 0):
                blank.append(f"seq {index.last_seq}, building {index.resync_building}")
            await asyncio.sleep(0)

    async def until(done: Callable[[], bool]) -> None:
        while not done():  # noqa: ASYNC110 (the follower and the fakes change plain state)
            await asyncio.sleep(0.001)

    async def main() -> None:
        following = asyncio.create_task(follower.run())
        await asyncio.wait_for(until(lambda: index.last_seq == 1), WAIT_S)
        watching = asyncio.create_task(watch())
        try:
            for shard in range(SHARDS):  # shards start one at a time, 200 ms apart
                stream.events.append(m.ShardStarted(shard=shard, epoch=3))
                await asyncio.wait_for(until(lambda: index.last_seq == len(stream.events)), WAIT_S)
                now[0] += 0.2
            assert index.synced and index.resync_wanted and directory.listings == 0  # a burst
            now[0] += 1.0  # quiet for a second: one listing for them all
            await asyncio.wait_for(until(lambda: directory.listings == 1), WAIT_S)
            # While it is taken: events still applied to the view served, which still answers.
            stream.events.append(published(2, 1, "s1"))
            stream.events.append(m.ShardStarted(shard=5, epoch=4))  # after the listing's sequence
            await asyncio.wait_for(until(lambda: index.last_seq == len(stream.events)), WAIT_S)
            assert len(index.available_run([key(0), key(1), key(2)], 0)) == 3
            directory.release[0].set()
            # Swapped in, the events after its sequence replayed on it: the directory's groups.
            await asyncio.wait_for(
                until(lambda: index.counters["resyncs"] == 2 and index.last_seq == len(stream.events)), WAIT_S
            )
            assert set(index.groups) == {key(1), key(2), key(3)}  # 0's eviction learnt
            assert stream.starts == [1, SHARDS + 2]  # read on after the listing's sequence
            # The marker after its sequence asks again, once the interval after it has passed.
            assert index.resync_wanted
            for _ in range(20):
                await asyncio.sleep(0.005)
            assert directory.listings == 1
            now[0] += 3.0
            await asyncio.wait_for(until(lambda: directory.listings == 2), WAIT_S)
            directory.release[1].set()
            await asyncio.wait_for(until(lambda: index.counters["resyncs"] == 3), WAIT_S)
            assert not index.resync_wanted and directory.listings == 2
        finally:
            # (re-cancelled: Python 3.11's `wait_for` loses a cancel that lands as its inner
            # call ends, the follower's unsubscribe after a swap)
            await cancel_and_wait([watching, following], WAIT_S)

    asyncio.run(main())
    assert blank == [], f"routes found the index blank: {blank[:5]}"
    assert index.counters["shard_starts"] >= SHARDS + 1
    index.check_invariants()


def test_a_stale_listing_that_fails_is_tried_again_and_the_view_served_meanwhile() -> None:
    index = RoutingIndex()
    index.resync([ListedSegment("s1", 1, True)], [], at_seq=0)
    stream, directory = Stream(), Directory()
    now = [1_000.0]
    follower = follower_of(index)
    follower.nc = cast(Any, stream)
    follower.router = cast(Any, directory)
    follower.clock = lambda: now[0]
    follower._leaders_checked_s = now[0]
    follower._listed_epochs = dict(directory.epochs)
    stream.events += [published(0, 1, "s1"), m.ShardStarted(shard=0, epoch=3)]
    directory.groups = [0]
    failing = [True]
    list_groups = directory.list_groups

    async def flaky(query: m.ListGroups, timeout_s: float, pages_max: int) -> list[Any]:
        if failing[0]:
            directory.listings += 1
            raise Unavailable("shard failing over")
        return await list_groups(query, timeout_s, pages_max)

    directory.list_groups = flaky  # type: ignore[method-assign]

    async def until(done: Callable[[], bool]) -> None:
        while not done():  # noqa: ASYNC110 (the follower and the fakes change plain state)
            await asyncio.sleep(0.001)

    async def main() -> None:
        following = asyncio.create_task(follower.run())
        try:
            await asyncio.wait_for(until(lambda: index.last_seq == 2), WAIT_S)
            now[0] += 1.0
            await asyncio.wait_for(
                until(lambda: directory.listings == 1 and follower.resync_failures == 1), WAIT_S
            )
            for _ in range(20):
                await asyncio.sleep(0.005)
            assert directory.listings == 1  # not again before the interval
            assert index.synced and index.resync_wanted and index.available_run([key(0)], 0)
            failing[0] = False
            now[0] += 3.0
            await asyncio.wait_for(until(lambda: directory.listings == 2), WAIT_S)
            directory.release[-1].set()
            await asyncio.wait_for(until(lambda: index.counters["resyncs"] == 2), WAIT_S)
            assert index.synced and not index.resync_wanted and set(index.groups) == {key(0)}
        finally:
            await cancel_and_wait([following], WAIT_S)

    asyncio.run(main())

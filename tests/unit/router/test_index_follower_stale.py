"""A burst of `shard_started` markers (16 shards starting one at a time after a failover or a
cold start) makes the router's index follower list the directory once, not once per marker,
and the index answers throughout: before the listing, while it is taken and indexed (events
still applied to the view served) and after its swap. Until 2026-12-07 each marker made the
index answer nothing until its own listing was done (seconds at 400k groups). The swap never
takes the view served back (the events after the listing's sequence are replayed onto the new
view first), and a listing given up cannot write into the next one's view."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import msgspec

from kvfabric.core.routing_index import ListedSegment, RoutingIndex, StaleResyncPacing
from kvfabric.format.errors import Unavailable
from kvfabric.format.ids import ChainHash, pack_group_key
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.runtime.deadline import cancel_and_wait
from tests.unit.router.test_index_follower_batches import DOMAIN, follower_of, published, summary

SHARDS = 16
WAIT_S = 20.0  # generous: CI's loaded cores (each step takes milliseconds)


def key(i: int) -> bytes:
    return pack_group_key(DOMAIN, ChainHash(i.to_bytes(32, "little")))


class Stream:
    """The events stream: appended to by the test, read by pull subscriptions from a start."""

    def __init__(self) -> None:
        self.events: list[msgspec.Struct] = []
        self.starts: list[int] = []  # where each subscription began
        self.is_connected = True
        self.skip: set[int] = set()  # sequences never delivered (lost: a gap)
        self.yields = 0  # turns of the loop a fetch takes (a real one waits on the network)

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
        for _turn in range(self.stream.yields):
            await asyncio.sleep(0)
        events = self.stream.events
        if self.next > len(events):
            await asyncio.sleep(0.002)
            raise TimeoutError  # (as nats-py's: nothing new within the fetch's wait)
        batch = []
        for seq in range(self.next, min(len(events), self.next + n - 1) + 1):
            meta = SimpleNamespace(sequence=SimpleNamespace(stream=seq), num_pending=len(events) - seq)
            if seq not in self.stream.skip:
                batch.append(SimpleNamespace(data=encode(events[seq - 1]), metadata=meta))
        self.next = min(len(events), self.next + n - 1) + 1
        return batch

    async def unsubscribe(self) -> None:
        return None


def segment_info(seg: str) -> m.SegmentInfo:
    return m.SegmentInfo(
        segment_id=seg, incarnation=1, domain=m.FailureDomain(host="h"), up=True, draining=False,
        capacity_bytes=1, reserved_bytes=0, reported_used_bytes=0, last_heartbeat_ms=0, data_addr="",
    )  # fmt: skip


class Directory:
    """The shard map and the listing; each listing waits for the test to let it end."""

    def __init__(self) -> None:
        self.epochs = {s: 2 for s in range(SHARDS)}
        self.listings = 0
        self.release: list[asyncio.Event] = []
        self.groups: list[int] = []  # what a listing answers
        self.on: dict[int, str] = {}  # the segment of a group's replica (s1 when not named)
        self.up = ["s1"]  # the segments up

    async def refresh(self) -> None:
        return None

    async def segments(self, timeout_s: float) -> m.SegmentList:
        infos = [segment_info(seg) for seg in self.up]
        return m.SegmentList(epoch=0, segments=infos)

    async def list_groups(self, query: m.ListGroups, timeout_s: float, pages_max: int) -> list[Any]:
        self.listings += 1
        self.release.append(asyncio.Event())
        answer = [summary(i, self.on.get(i, "s1")) for i in self.groups]  # as of now
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
            # the follower's subscription, and the catch-up's: the events after the listing's
            # sequence replayed onto the new view before the swap (the follower reads on)
            assert stream.starts == [1, SHARDS + 2]
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


async def until(done: Callable[[], bool]) -> None:
    while not done():  # noqa: ASYNC110 (the follower and the fakes change plain state)
        await asyncio.sleep(0.001)


def test_the_swap_never_takes_the_view_served_back_to_the_listings_sequence() -> None:
    """Each shard is listed at its own moment: a listing may show a group evicted, or a replica
    on a segment gone down, after the stream sequence noted before it. The view served had
    applied those events; swapped in as of that sequence (`last_seq` set back), the new view
    counted those groups again until the replay reached them, and the router trusted it
    (synced, heard from before the swap: good for 5 s). Now the events up to the view served
    are replayed onto the new view before the swap: no route ever counts them again."""
    index = RoutingIndex()
    index.resync([ListedSegment("s1", 1, True), ListedSegment("s2", 1, True)], [], at_seq=0)
    stream, directory = Stream(), Directory()
    stream.yields = 3  # (a real fetch gives the loop, routes, a turn or more)
    follower = follower_of(index)
    follower.nc = cast(Any, stream)
    follower.router = cast(Any, directory)
    follower.pacing = StaleResyncPacing(quiet_ms=0)  # (no burst to wait for)
    follower._listed_epochs = dict(directory.epochs)
    stream.events += [published(0, 1, "s1"), published(1, 1, "s2"), m.ShardStarted(shard=0, epoch=3)]
    directory.groups, directory.on, directory.up = [0, 1], {1: "s2"}, ["s1", "s2"]
    wrong: list[str] = []  # turns of the loop where a route counted what the stream took away
    seqs: list[int] = []  # the index's sequence as routes saw it

    async def watch() -> None:
        while True:
            if index.synced:
                seqs.append(index.last_seq)
                counted = [i for i in (0, 1) if index.available_run([key(i)], 0)]
                if counted:
                    wrong.append(f"groups {counted} counted at seq {index.last_seq}")
            await asyncio.sleep(0)

    async def main() -> None:
        following = asyncio.create_task(follower.run())
        watching: asyncio.Task[None] | None = None
        try:
            await asyncio.wait_for(until(lambda: directory.listings == 1), WAIT_S)  # (listed 0, 1)
            # While it is taken: group 0 evicted, segment s2 (group 1's replica) down.
            stream.events.append(
                m.GroupEvicted(group=ChainHash((0).to_bytes(32, "little")), reason="x", domain=DOMAIN)
            )
            stream.events.append(m.SegmentDown(segment_id="s2", incarnation=1, reason="heartbeat_timeout"))
            await asyncio.wait_for(until(lambda: index.last_seq == 5), WAIT_S)
            assert (
                index.synced and not index.available_run([key(0)], 0) and not index.available_run([key(1)], 0)
            )
            watching = asyncio.create_task(watch())
            directory.release[0].set()
            await asyncio.wait_for(until(lambda: index.counters["resyncs"] == 2), WAIT_S)
            for _ in range(50):  # the follower reads on
                await asyncio.sleep(0.001)
        finally:
            await cancel_and_wait([t for t in (watching, following) if t is not None], WAIT_S)

    asyncio.run(main())
    assert wrong == [], f"the swap counted again what the stream took away: {wrong[:5]}"
    assert seqs and min(seqs) == 5, "the view served went back to the listing's sequence"
    assert index.synced and index.last_seq == 5 and not index.resync_wanted
    assert index.groups == {} and index.segments == {"s1": 1}  # (group 1's dead replica swept)
    index.check_invariants()


def test_a_listing_given_up_still_running_cannot_write_into_the_gap_listings_view() -> None:
    """A stale listing's task that swallows its cancellation (Python 3.11's `wait_for` can, for a
    whole request timeout) outlives `cancel_and_wait` when a gap makes the follower list again.
    It went on with `resync_start`/`resync_add` on the same index: the gap listing's view was
    replaced by its own, older one, and that was swapped in. Now a listing given up starts no
    view, and writes through its own build token (the core ignores a stale one's)."""
    index = RoutingIndex()
    index.resync([ListedSegment("s1", 1, True)], [], at_seq=0)
    stream, directory = Stream(), Directory()
    follower = follower_of(index)
    follower.request_timeout_s = 0.3  # (how long `cancel_and_wait` waits for the listing)
    follower.nc = cast(Any, stream)
    follower.router = cast(Any, directory)
    follower.pacing = StaleResyncPacing(quiet_ms=0)
    follower._listed_epochs = dict(directory.epochs)
    stream.events += [published(0, 1, "s1"), m.ShardStarted(shard=0, epoch=3)]
    swallowed = [0]

    async def listing(query: m.ListGroups, timeout_s: float, pages_max: int) -> list[Any]:
        if directory.listings == 0:  # the stale listing: it swallows every cancellation
            directory.listings += 1
            directory.release.append(asyncio.Event())
            answer = [summary(5)]
            while not directory.release[0].is_set():
                try:
                    await directory.release[0].wait()
                except asyncio.CancelledError:
                    swallowed[0] += 1
            return answer
        directory.release[0].set()  # the gap listing: the stale one goes on at once
        directory.listings += 1
        return [summary(7)]

    directory.list_groups = listing  # type: ignore[method-assign]

    async def main() -> None:
        following = asyncio.create_task(follower.run())
        try:
            await asyncio.wait_for(until(lambda: directory.listings == 1), WAIT_S)
            stream.skip.add(3)  # lost: the follower sees a gap at 4 and lists again
            stream.events += [published(6, 1, "s1"), m.GroupsAccessed(groups=[])]
            await asyncio.wait_for(until(lambda: directory.listings == 2 and index.synced), WAIT_S)
            for _ in range(50):  # the leftover task ends; the follower reads on
                await asyncio.sleep(0.001)
        finally:
            await cancel_and_wait([following], WAIT_S)

    asyncio.run(main())
    assert swallowed[0] >= 1  # the listing outlived `cancel_and_wait`
    assert set(index.groups) == {key(7)}, "the view swapped in is not the gap listing's"
    assert index.synced and index.last_seq == 4 and index.counters["resyncs"] == 2
    assert follower.listings_left_running == 1
    index.check_invariants()

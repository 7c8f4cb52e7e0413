"""The router's index follower lets the loop (routes) run while it applies a batch: one event a
turn (512 commits of 256 groups at once held it ~1 s), then a lost segment's groups leave the
index in slices (`RoutingIndex.sweep`)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any, cast

import msgspec

from kvfabric.core.routing import RoutingCore
from kvfabric.core.routing_index import ListedSegment, RoutingIndex, StaleResyncPacing
from kvfabric.format.ids import ChainHash, DomainDigest, Namespace
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.router.index_follower import EVENTS_FETCH_MAX, IndexFollower, caught_up
from kvfabric.router.settings import load_router_settings
from kvfabric.runtime.deadline import cancel_and_wait
from tests.unit.router.test_settings_refit import ENV, scrape

DOMAIN = DomainDigest(b"A" * 16)
NAMESPACE = Namespace(bytes(4) + DOMAIN + bytes(34))


def message(seq: int, event: msgspec.Struct) -> Any:
    return SimpleNamespace(data=encode(event), metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq)))


def published(first: int, count: int, segment: str) -> m.GroupsPublished:
    return m.GroupsPublished(
        groups=[
            m.GroupPublished(
                group=ChainHash(i.to_bytes(32, "little")),
                chunk_index=0,
                members=1,
                namespace=NAMESPACE,
                placements=[m.SegmentBytes(segment, 10)],
            )
            for i in range(first, first + count)
        ]
    )


async def no_op() -> None:
    return None


def follower_of(index: RoutingIndex) -> IndexFollower:
    return IndexFollower(
        cast(Any, None),
        index,
        domain_digest=DOMAIN,
        heard=no_op,
        request_timeout_s=1.0,
        listing_pages_max=1,
    )


def test_a_batch_is_applied_one_event_a_turn_then_a_lost_segment_is_swept_in_slices() -> None:
    index = RoutingIndex()
    index.resync([ListedSegment("s1", 1, True), ListedSegment("s2", 1, True)], [], at_seq=0)
    events: list[msgspec.Struct] = [published(i * 256, 256, "s1" if i % 2 else "s2") for i in range(20)]
    events.append(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"))
    batch = [message(seq, event) for seq, event in enumerate(events, start=1)]

    async def run() -> list[tuple[int, int]]:
        follower = follower_of(index)
        applying = asyncio.create_task(follower.apply_batch(batch))
        seen: list[tuple[int, int]] = []  # per loop turn: events applied, dead replicas left
        while not applying.done():
            seen.append((index.last_seq, index.dead_replicas))
            await asyncio.sleep(0)
        await applying
        return seen

    seen = asyncio.run(run())
    assert len({seq for seq, _ in seen if 0 < seq < len(events)}) >= 10, "the batch ran in one turn"
    sweeping = {dead for seq, dead in seen if seq == len(events) and dead}
    assert len(sweeping) >= 2, "the lost segment was swept in one turn"
    assert index.last_seq == len(events) and index.dead_replicas == 0
    assert len(index.groups) == 10 * 256  # those on s2
    index.check_invariants()


def test_metrics_show_the_replicas_of_a_lost_segment_left_to_sweep() -> None:
    settings = load_router_settings(ENV)
    index = RoutingIndex()
    index.resync([ListedSegment("s1", 1, True)], [], at_seq=0)
    core = RoutingCore(settings.routing, [e.spec for e in settings.engines], index)
    assert index.apply(1, published(0, 3, "s1")) == "applied"
    assert index.apply(2, m.SegmentDown(segment_id="s1", incarnation=1, reason="drained")) == "applied"
    assert 'kvfabric_router_state{name="index_dead_replicas"} 3.0' in scrape(core)
    sweeps = 1
    while index.sweep(1):  # one replica a call: more left after the first two
        sweeps += 1
    assert sweeps == 3
    assert 'kvfabric_router_state{name="index_dead_replicas"} 0.0' in scrape(core)
    assert 'kvfabric_router_state{name="index_groups"} 0.0' in scrape(core)


def summary(i: int, segment: str = "s1") -> m.GroupSummary:
    """A listed group of chain hash `i` (little-endian), one object on `segment`."""
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
                replicas=[m.Replica(segment_id=segment, incarnation=1, slot=1, slot_generation=1)],
            )
        ],
    )


def test_a_resync_indexes_its_listing_in_slices_routes_served_between() -> None:
    """400k listed groups converted and indexed in one call held the router's loop 3.1 s (its
    HTTP front, `route`, health checks frozen; review, 2026-12-06): now `RESYNC_SLICE_GROUPS` a
    turn, into a view of its own swapped in after the last slice."""
    from kvfabric.router import index_follower

    n = 5 * index_follower.RESYNC_SLICE_GROUPS + 7
    summaries = [summary(i) for i in range(n)]

    class Listing:
        def __init__(self) -> None:
            self.epochs = {0: 1}  # the shards' leader epochs (the listing records them)

        async def segments(self, timeout_s: float) -> m.SegmentList:
            info = m.SegmentInfo(
                segment_id="s1", incarnation=1, domain=m.FailureDomain(host="h"), up=True, draining=False,
                capacity_bytes=1, reserved_bytes=0, reported_used_bytes=0, last_heartbeat_ms=0, data_addr="",
            )  # fmt: skip
            return m.SegmentList(epoch=1, segments=[info])

        async def list_groups(self, query: m.ListGroups, timeout_s: float, pages_max: int) -> list[Any]:
            return summaries

    index = RoutingIndex()
    follower = follower_of(index)
    follower.router = cast(Any, Listing())

    async def run() -> list[int]:
        resync = asyncio.create_task(follower.resync(at_seq=42))
        seen: list[int] = []  # groups indexed at each turn of the loop, before the swap
        while not resync.done():
            building = index.resync_building
            if building is not None:
                seen.append(building)
                assert not index.synced and index.groups == {}  # (a fresh index: nothing served)
            await asyncio.sleep(0)
        await resync
        return seen

    seen = asyncio.run(run())
    assert len(set(seen)) >= 5, "the listing was indexed in one turn"
    assert index.synced and index.last_seq == 42 and len(index.groups) == n


def test_a_failed_fetch_unsubscribes_before_the_retry(monkeypatch: Any) -> None:
    """Each failed fetch (a lost consumer: 503) left its subscription behind, one per retry."""
    import nats.js.errors

    from kvfabric.router import index_follower as follower_module

    monkeypatch.setattr(follower_module, "RETRY_S", 0.01)
    subs: list[Any] = []

    class Sub:
        def __init__(self) -> None:
            self.unsubscribed = False

        async def fetch(self, *args: Any, **kwargs: Any) -> Any:
            if len(subs) == 1:
                raise nats.js.errors.APIError(code=503, description="consumer gone")
            await asyncio.sleep(3600)

        async def unsubscribe(self) -> None:
            self.unsubscribed = True

    class Js:
        async def stream_info(self, name: str) -> Any:
            return SimpleNamespace(state=SimpleNamespace(first_seq=1, last_seq=0), created=None)

        async def pull_subscribe(self, *args: Any, **kwargs: Any) -> Any:
            subs.append(Sub())
            return subs[-1]

    index = RoutingIndex()
    index.resync([], [], at_seq=0)
    follower = follower_of(index)
    follower.nc = cast(Any, SimpleNamespace(jetstream=lambda timeout: Js()))

    async def run() -> None:
        task = asyncio.create_task(follower.run())
        while len(subs) < 2:  # noqa: ASYNC110 (the fake's subscriptions are plain appends)
            await asyncio.sleep(0.01)
        assert subs[0].unsubscribed and not subs[1].unsubscribed
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 5))
    assert all(s.unsubscribed for s in subs)


def test_a_shard_led_under_a_newer_epoch_than_at_the_listing_makes_the_index_list_again() -> None:
    """A new leader's rebuild emits no event for what it adopted or lost (a segment that missed
    its report never goes `segment_down`; an event the old leader had not published is gone,
    with no gap in the sequences): an index that kept following held what the directory no
    longer does, for good (review, stop 67). The follower compares the shard map's epochs with
    the listing's every `LEADERS_CHECK_S`."""

    class Router:
        def __init__(self) -> None:
            self.epochs = {0: 3, 1: 5}
            self.refreshes = 0

        async def refresh(self) -> None:
            self.refreshes += 1

    async def run() -> None:
        index = RoutingIndex()
        index.resync([ListedSegment("s1", 1, True)], [], at_seq=0)
        follower = follower_of(index)
        router = Router()
        follower.router = cast(Any, router)
        follower._listed_epochs = {0: 3, 1: 5}
        follower._leaders_checked_s = 0.0
        await follower.check_leaders()
        assert router.refreshes == 1 and index.synced  # the same leaders: nothing
        await follower.check_leaders()
        assert router.refreshes == 1  # not again before LEADERS_CHECK_S
        follower._leaders_checked_s = 0.0
        router.epochs[1] = 6  # shard 1 failed over
        await follower.check_leaders()
        # stale, not blank (a listing follows, as on a `shard_started` marker)
        assert index.synced and index.resync_wanted and index.counters["leader_changes"] == 1

    asyncio.run(run())


def test_a_follower_behind_the_stream_is_not_heard_as_current() -> None:
    """Heard from was taken as caught up: seconds behind, the index was still trusted and its
    groups evicted in events not applied yet counted (review, stop 67). A batch counts as heard
    only when at most one more fetch's events are pending after it."""

    def batch(pending: int | None) -> list[Any]:
        return [SimpleNamespace(metadata=SimpleNamespace(num_pending=pending))]

    assert caught_up([]) and caught_up(batch(0)) and caught_up(batch(None))
    assert caught_up(batch(EVENTS_FETCH_MAX)) and not caught_up(batch(EVENTS_FETCH_MAX + 1))


class _CutOff:
    """A NATS connection whose fetches time out: cut off (`connected` False), or at the end of a
    stream whose last sequence is `last_seq`."""

    def __init__(self, connected: bool, last_seq: int) -> None:
        self.is_connected = connected
        self.last_seq = last_seq
        self.fetches = 0
        self.enough = asyncio.Event()  # set once `wanted` fetches were made
        self.wanted = 0

    def jetstream(self, timeout: float) -> Any:
        return self

    async def stream_info(self, name: str) -> Any:
        if not self.is_connected:
            raise TimeoutError
        return SimpleNamespace(state=SimpleNamespace(first_seq=1, last_seq=self.last_seq), created=None)

    async def pull_subscribe(self, *args: Any, **kwargs: Any) -> Any:
        return self

    async def fetch(self, n: int, **_: float) -> Any:
        self.fetches += 1
        if self.fetches >= self.wanted:
            self.enough.set()
        await asyncio.sleep(0)
        raise TimeoutError

    async def unsubscribe(self) -> None:
        return None


def _heard_while(nc: _CutOff, index: RoutingIndex, fetches: int) -> int:
    heard = [0]

    async def on_heard() -> None:
        heard[0] += 1

    follower = IndexFollower(
        cast(Any, nc), index, domain_digest=DOMAIN, heard=on_heard, request_timeout_s=1.0, listing_pages_max=1
    )

    async def no_leaders() -> None:
        return None

    follower.check_leaders = no_leaders  # type: ignore[method-assign]

    async def run() -> None:
        nc.wanted, nc.enough = fetches, asyncio.Event()
        task = asyncio.create_task(follower.run())
        await nc.enough.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run())
    return heard[0]


def test_fetch_timeouts_count_as_heard_only_when_the_stream_says_the_index_is_at_its_end() -> None:
    """nats-py raises the same timeout for a fetch with the connection down as at the end of
    the stream: a router cut off from NATS counted its index current for as long, and a resumed
    subscription was heard before it knew how far behind it was (review, stop 68)."""
    index = RoutingIndex()
    index.resync([ListedSegment("s1", 1, True)], [], at_seq=10)
    cut_off = _CutOff(connected=True, last_seq=10)
    assert _heard_while(cut_off, index, fetches=3) >= 2  # at the end: heard
    cut_off = _CutOff(connected=True, last_seq=10)
    cut_off.is_connected = False  # (stream_info answered once at subscribe, then cut off)

    async def first_info(name: str) -> Any:
        return SimpleNamespace(state=SimpleNamespace(first_seq=1, last_seq=10), created=None)

    cut_off.stream_info = first_info  # type: ignore[method-assign]
    assert _heard_while(cut_off, index, fetches=3) == 0
    behind = _CutOff(connected=True, last_seq=9_000)  # connected, 8,990 events not yet fetched
    assert _heard_while(behind, index, fetches=3) == 0


def test_a_shard_started_event_makes_the_follower_list_again_and_read_on_after_it() -> None:
    """A shard's new core may follow one that stopped with events queued, never published (a
    handover drains them for at most 1 s): no sequence, so no gap; the index kept an evicted
    group for good. The new core's first event, `shard_started`, asks for a listing: the
    follower reads on, lists the directory (as of the stream's end then, seq 3: nothing to
    replay onto it), swaps the listing in and reads on where it was."""
    events: list[msgspec.Struct] = [
        published(0, 1, "s1"),
        m.ShardStarted(shard=0, epoch=2),
        published(1, 1, "s1"),
    ]
    starts: list[int] = []  # where each subscription began

    def msg(seq: int) -> Any:
        meta = SimpleNamespace(sequence=SimpleNamespace(stream=seq), num_pending=len(events) - seq)
        return SimpleNamespace(data=encode(events[seq - 1]), metadata=meta)

    class Sub:
        def __init__(self, start: int) -> None:
            self.start = start
            self.fetched = False

        async def fetch(self, *args: Any, **kwargs: Any) -> Any:
            if self.fetched or self.start > len(events):
                await asyncio.sleep(0.01)
                raise TimeoutError  # (as nats-py's, nothing new within the fetch's wait)
            self.fetched = True
            return [msg(seq) for seq in range(self.start, len(events) + 1)]

        async def unsubscribe(self) -> None:
            return None

    class Js:
        async def stream_info(self, name: str) -> Any:
            return SimpleNamespace(state=SimpleNamespace(first_seq=1, last_seq=len(events)), created=None)

        async def pull_subscribe(self, *args: Any, config: Any, **kwargs: Any) -> Any:
            starts.append(config.opt_start_seq)
            return Sub(config.opt_start_seq)

    class Listing:
        def __init__(self) -> None:
            self.epochs = {0: 2}  # the shards' leader epochs (the listing records them)

        async def segments(self, timeout_s: float) -> m.SegmentList:
            info = m.SegmentInfo(
                segment_id="s1", incarnation=1, domain=m.FailureDomain(host="h"), up=True, draining=False,
                capacity_bytes=1, reserved_bytes=0, reported_used_bytes=0, last_heartbeat_ms=0, data_addr="",
            )  # fmt: skip
            return m.SegmentList(epoch=2, segments=[info])

        async def list_groups(self, query: m.ListGroups, timeout_s: float, pages_max: int) -> list[Any]:
            return []  # the new core holds nothing (the old one's eviction was never published)

    index = RoutingIndex()
    index.resync([ListedSegment("s1", 1, True)], [], at_seq=0)
    follower = follower_of(index)
    follower.nc = cast(Any, SimpleNamespace(jetstream=lambda timeout: Js(), is_connected=True))
    follower.router = cast(Any, Listing())
    follower.pacing = StaleResyncPacing(quiet_ms=0)  # (no burst to wait for)

    async def run() -> None:
        task = asyncio.create_task(follower.run())
        while index.counters["resyncs"] < 2:  # noqa: ASYNC110 (the fakes change plain state)
            await asyncio.sleep(0.01)
        await cancel_and_wait([task], 5)  # (re-cancelled: 3.11's `wait_for` can lose one)

    asyncio.run(asyncio.wait_for(run(), 10))
    assert starts == [1]  # read on past the marker (seq 2), listed as of 3, read on after it
    assert index.synced and index.last_seq == 3 and index.groups == {}
    assert index.counters["shard_starts"] == 1 and index.counters["resyncs"] == 2

"""The router's index follower drops the late events of a directory shard core that a newer epoch
replaced: a handover drains the old core's queued events while its lease key is released (and
nats-py may flush a cancelled publish on reconnect), so one can land after the new core's
`shard_started`, past the listing that marker asked for; applied, the index held a group the
directory no longer has (or dropped one it has), with no marker after it to list again. Every event
names its core in the `Kvf-Shard-Epoch` header; one naming an epoch below the highest seen for its
shard is fenced (in sequence, not applied, counted `index_events_fenced`), in the follower's own
reads and in the catch-up's replay onto a listing's view; one without the header (an older
directory) is applied as before."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import msgspec

from kvfabric.core.routing import RoutingCore
from kvfabric.core.routing_index import ListedSegment, RoutingIndex
from kvfabric.format.ids import ChainHash, pack_group_key
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.router.settings import load_router_settings
from kvfabric.testing.logs import RecordingLog
from tests.unit.router.test_index_follower_batches import DOMAIN, follower_of, published
from tests.unit.router.test_settings_refit import ENV, scrape

WAIT_S = 20.0  # generous: a loaded machine


def key(i: int) -> bytes:
    return pack_group_key(DOMAIN, ChainHash(i.to_bytes(32, "little")))


def message(seq: int, event: msgspec.Struct, origin: tuple[int, int] | None, pending: int = 0) -> Any:
    """A JetStream message of the directory's events as nats-py delivers it (headers: None
    when the event has none)."""
    meta = SimpleNamespace(sequence=SimpleNamespace(stream=seq), num_pending=pending)
    headers = m.shard_epoch_header(*origin) if origin is not None else None
    return SimpleNamespace(data=encode(event), metadata=meta, headers=headers)


def synced_index() -> RoutingIndex:
    index = RoutingIndex()
    index.resync([ListedSegment("s1", 1, True)], [], at_seq=0)
    return index


def test_a_late_event_of_a_replaced_core_is_not_applied_and_counted() -> None:
    index = synced_index()
    settings = load_router_settings(ENV)
    core = RoutingCore(settings.routing, [e.spec for e in settings.engines], index)
    follower = follower_of(index)
    batch = [
        message(1, m.ShardStarted(shard=0, epoch=5), (0, 5)),  # the new core of shard 0
        message(2, published(0, 1, "s1"), (0, 4)),  # the old core's late publication
        message(3, published(1, 1, "s1"), (0, 5)),  # the new core's
        message(4, published(2, 1, "s1"), None),  # an older directory's: no header
        message(5, m.ShardStarted(shard=0, epoch=4), (0, 4)),  # a stale marker: no listing on it
        message(6, published(3, 1, "s1"), (1, 4)),  # another shard has its own epochs
    ]
    asyncio.run(asyncio.wait_for(follower.apply_batch(batch), WAIT_S))
    assert index.synced and index.last_seq == 6  # in sequence: no gap after a fenced event
    assert set(index.groups) == {key(1), key(2), key(3)}
    assert index.counters["events_fenced"] == 2
    assert index.counters["shard_starts"] == 1  # the stale marker asked for nothing
    assert 'kvfabric_router_state{name="index_events_fenced"} 2.0' in scrape(core)


def test_the_catch_up_replays_onto_a_listings_view_without_the_late_events() -> None:
    """A stale index's listing (as of seq 1, the marker) is caught up from the stream before its
    swap: the late event after the marker is fenced there too, or the view swapped in would hold
    the group the follower had dropped."""
    index = synced_index()
    follower = follower_of(index)
    batch = [
        message(1, m.ShardStarted(shard=0, epoch=5), (0, 5), pending=2),
        message(2, published(0, 1, "s1"), (0, 4), pending=1),
        message(3, published(1, 1, "s1"), (0, 5), pending=0),
    ]

    class Sub:
        def __init__(self, start: int) -> None:
            self.next = start

        async def fetch(self, n: int, **_: Any) -> list[Any]:
            got = batch[self.next - 1 : self.next - 1 + n]
            self.next += len(got)
            return got

        async def unsubscribe(self) -> None:
            return None

    class Js:
        async def pull_subscribe(self, *args: Any, config: Any, **kwargs: Any) -> Sub:
            return Sub(config.opt_start_seq)

    async def run() -> bool:
        await follower.apply_batch(batch)
        assert index.resync_wanted and set(index.groups) == {key(1)}
        token = index.resync_start([ListedSegment("s1", 1, True)], at_seq=1)  # lists nothing
        return await follower._catch_up(Js(), token, 1) and index.resync_done(token)

    assert asyncio.run(asyncio.wait_for(run(), WAIT_S))
    assert index.last_seq == 3 and not index.resync_wanted
    assert set(index.groups) == {key(1)}
    assert index.counters["events_fenced"] == 2  # the follower's and the replay's


class Directory:
    """The directory as the router sees it: shard 0 led under `before` when the groups' listing
    begins, its pages answered under `paged` (a newer leader the router finds on the way: a
    `wrong_shard` answer, the map asked again, `DirectoryRouter.epochs` raised by the reply)."""

    def __init__(self, before: int, paged: int) -> None:
        self.epochs = {0: before}
        self.paged = paged

    async def segments(self, timeout_s: float) -> m.SegmentList:
        info = m.SegmentInfo(
            segment_id="s1", incarnation=1, domain=m.FailureDomain(host="h"), up=True, draining=False,
            capacity_bytes=1, reserved_bytes=0, reported_used_bytes=0, last_heartbeat_ms=0, data_addr="",
        )  # fmt: skip
        return m.SegmentList(epoch=self.epochs[0], segments=[info])

    async def list_groups(self, query: m.ListGroups, timeout_s: float, pages_max: int) -> list[Any]:
        await asyncio.sleep(0)
        self.epochs[0] = max(self.epochs[0], self.paged)
        return []


def test_a_gap_listing_fences_the_predecessors_of_the_leaders_it_listed() -> None:
    """The events a gap lost may hold a shard's marker: the listing's shard map epochs fence the
    late events of the cores they replaced all the same."""
    index = RoutingIndex()
    follower = follower_of(index)
    follower.router = cast(Any, Directory(before=5, paged=5))  # shard 0 led under epoch 5

    async def run() -> None:
        await follower.resync(at_seq=10)  # the stream's events up to 10 are gone
        await follower.apply_batch(
            [message(11, published(0, 1, "s1"), (0, 4)), message(12, published(1, 1, "s1"), (0, 5))]
        )

    asyncio.run(asyncio.wait_for(run(), WAIT_S))
    assert index.synced and index.last_seq == 12
    assert set(index.groups) == {key(1)} and index.counters["events_fenced"] == 1


def test_a_gap_listing_fences_by_the_leaders_that_answered_its_pages() -> None:
    """Review, 2026-12-07: the gap lost events 1-10, among them the marker of shard 0's core under
    epoch 5; the router knew epoch 4 as the listing began, and epoch 5's core answered its pages
    (found on the way). The fence was raised to the copy taken before the pages (4): the old
    core's late publication at 11 was applied, the index held a group the directory lacks. The
    epochs the shard map is compared with later stay those known as the listing began (a leader
    moved meanwhile is listed again: the lower, the safer)."""
    index = RoutingIndex()
    follower = follower_of(index)
    follower.router = cast(Any, Directory(before=4, paged=5))

    async def run() -> None:
        await follower.resync(at_seq=10)  # the stream's events up to 10 are gone
        await follower.apply_batch(
            [message(11, published(0, 1, "s1"), (0, 4)), message(12, published(1, 1, "s1"), (0, 5))]
        )

    asyncio.run(asyncio.wait_for(run(), WAIT_S))
    assert index.synced and index.last_seq == 12
    assert index.fence.highest(0) == 5
    assert set(index.groups) == {key(1)} and index.counters["events_fenced"] == 1
    assert follower._listed_epochs == {0: 4}


def test_a_replaced_cores_late_events_are_logged_once_for_each_shard_and_epoch() -> None:
    """A drained outbox puts a thousand or two late events of one core in the stream: each one
    logged at info flooded the log. The first of each (shard, epoch) is logged, the rest
    counted."""
    index = synced_index()
    follower = follower_of(index)
    logged = RecordingLog()
    follower._log = cast(Any, logged)
    origins = [(0, 5), *[(0, 4)] * 50, (1, 7), *[(1, 6)] * 20, *[(0, 3)] * 5, (0, 4), (1, 2)]
    batch = [
        message(
            seq,
            m.ShardStarted(shard=s, epoch=e) if (s, e) in {(0, 5), (1, 7)} else published(seq, 1, "s1"),
            (s, e),
        )
        for seq, (s, e) in enumerate(origins, start=1)
    ]
    asyncio.run(asyncio.wait_for(follower.apply_batch(batch), WAIT_S))
    assert index.synced and index.last_seq == len(origins)
    assert index.counters["events_fenced"] == len(origins) - 2
    fenced = [fields["origin"] for _, event, fields in logged.lines if event == "event_fenced"]
    assert fenced == [(0, 4), (1, 6), (0, 3), (0, 4), (1, 2)]
    assert {level for level, event, _ in logged.lines if event == "event_fenced"} == {"info"}

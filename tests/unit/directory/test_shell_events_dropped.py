"""A shard shell stopped with events still queued drops them (a handover drains them for at most
`HANDOVER_DRAIN_MS`, 1 s; a rebuild's stop for `MISSING_SEGMENT_DRAIN_S`): they never got a
stream sequence, so the followers of the events stream saw no gap and kept a wrong view for good
(the router believed an evicted group was still there). Now the shard's next core starts with a
`ShardStarted` event, which the router's index takes as a gap (it lists the directory again), and
the dropped events are counted (`events_dropped`, exported as
`kvfabric_directory_events_dropped_total`). Against a fake JetStream that stops answering one
instance (no NATS here)."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any, cast

from kvfabric.core.directory import DirectoryConfig, DirectoryCore, EmitEvent
from kvfabric.core.routing_index import ListedSegment, RoutingIndex
from kvfabric.directory.metrics import DirectoryCollector
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.shell import DirectoryShell
from kvfabric.format.ids import ChainHash, DomainDigest, Namespace
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import SECRET

SHARD = 2
DOMAIN = DomainDigest(b"D" * 16)
NAMESPACE = Namespace(bytes(4) + DOMAIN + bytes(34))
GROUP = ChainHash(b"g" * 32)
KEY = DOMAIN + GROUP
DRAINED_S = 5.0  # generous: an outbox JetStream answers empties in milliseconds


class Stream:
    """The events stream: every instance's appends, numbered in order as JetStream does."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, str, bytes]] = []


class Connection:
    """One instance's NATS connection (what `EventPublisher` and `DirectoryShell` use of it):
    while `up` is False, JetStream does not answer its publishes (a partition, a stuck stream)."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.up = True
        self.is_connected = True

    def jetstream(self, **_: Any) -> Connection:
        return self

    async def publish(self, subject: str, payload: bytes, **_: Any) -> Any:
        while not self.up:  # noqa: ASYNC110 (a JetStream that never answers)
            await asyncio.sleep(0.01)
        seq = len(self.stream.messages) + 1
        self.stream.messages.append((seq, subject, payload))
        return SimpleNamespace(seq=seq)


class EventsStream:
    """What a shell needs of `kvfabric.directory.events.EventsStream` while publishing works."""

    def __init__(self, nc: Connection) -> None:
        self.nc = nc
        self.stuck: set[object] = set()
        # its counters (the collector reads the stream of every shell, folded ones too)
        self.failures: Counter[str] = Counter()
        self.recreated = 0
        self.repairs_failed = 0

    async def ensure(self) -> None:
        return None


def shell_of(epoch: int, nc: Connection, outbox_max: int = 100) -> DirectoryShell:
    core = DirectoryCore(DirectoryConfig(ticket_secret=SECRET), epoch=epoch, shard=SHARD)
    return DirectoryShell(
        core,
        tick_ms=3_600_000,  # no tick during the test
        events_outbox_max=outbox_max,
        events_max_age_s=60,
        free_timeout_s=1.0,
        events_stream=cast(Any, EventsStream(nc)),
    )


def published() -> EmitEvent:
    group = m.GroupPublished(
        group=GROUP,
        chunk_index=0,
        members=1,
        namespace=NAMESPACE,
        placements=[m.SegmentBytes("s1", 100)],
        group_bytes=100,
    )
    return EmitEvent("published", m.GroupsPublished(groups=[group]))


def follow(index: RoutingIndex, stream: Stream) -> None:
    """The router's follower: every event after the index's last, in order, while it is synced
    (not synced, it lists the directory before anything else)."""
    for seq, _, data in stream.messages[index.last_seq :]:
        if not index.synced:
            return
        index.apply(seq, m.event_decoder.decode(data))


def test_events_a_stopped_shell_dropped_make_the_followers_list_the_directory_again() -> None:
    stream = Stream()
    instance_a, instance_b = Connection(stream), Connection(stream)
    index = RoutingIndex()

    async def main() -> tuple[DirectoryShell, DirectoryShell]:
        old = shell_of(1, cast(Any, instance_a))
        await old.start(cast(Any, instance_a))
        # The router listed the directory (segment s1 up, nothing published) after what the
        # stream held then, and follows it from there.
        await old.drain_events(DRAINED_S)
        index.resync([ListedSegment("s1", 1, True)], [], at_seq=len(stream.messages))
        await old.perform([published()])
        await old.drain_events(DRAINED_S)
        follow(index, stream)
        assert [e.chunk_index for e in index.available_run([KEY], 0)] == [0]

        # JetStream stops answering instance A; the group is evicted and its event queued.
        instance_a.up = False
        evicted = m.GroupEvicted(group=GROUP, reason="pressure", domain=DOMAIN)
        await old.perform([EmitEvent("evicted", evicted)])
        # Handed over: no request reaches it any more; the drain ends with the event queued.
        old.may_act = lambda: False
        await old.drain_events(0.05)
        await old.stop(1.0)
        # The next leader's core (which does not hold the group) starts on instance B.
        new = shell_of(2, cast(Any, instance_b))
        await new.start(cast(Any, instance_b))
        await new.drain_events(DRAINED_S)
        await new.stop(1.0)
        return old, new

    old, new = asyncio.run(main())
    assert old.events_dropped == 1 and new.events_dropped == 0
    host = ShardHost(
        "dir-a",
        4,
        DirectoryConfig(ticket_secret=SECRET),
        registry=cast(Any, None),
        make_shell=cast(Any, None),
    )
    with host.retired.lock:
        host.retired.fold(old)  # what the host does once the old shell stopped
    dropped = [
        s.value
        for family in DirectoryCollector(host).collect()
        for s in family.samples
        if s.name == "kvfabric_directory_events_dropped_total"
    ]
    assert dropped == [1]

    # The eviction was never published; the new core's first event tells of the loss ...
    seq, subject, data = stream.messages[-1]
    assert subject == "kvf.v1.events.directory.shard_started"
    assert m.event_decoder.decode(data) == m.ShardStarted(shard=SHARD, epoch=2)
    assert not any(isinstance(m.event_decoder.decode(d), m.GroupEvicted) for _, _, d in stream.messages)
    # ... and the router's index, which still counted the evicted group, lists again: stale,
    # not blank (it keeps answering, the evicted group too, until the listing is swapped in).
    follow(index, stream)
    assert index.synced and index.resync_wanted and index.last_seq == seq
    assert index.counters["shard_starts"] == 1
    assert [e.chunk_index for e in index.available_run([KEY], 0)] == [0]
    index.resync([ListedSegment("s1", 1, True)], [], at_seq=seq)  # the new core holds nothing
    assert index.available_run([KEY], 0) == [] and not index.resync_wanted


def test_a_shell_that_drained_its_events_dropped_none() -> None:
    stream = Stream()
    nc = Connection(stream)

    async def main() -> DirectoryShell:
        shell = shell_of(1, cast(Any, nc))
        await shell.start(cast(Any, nc))
        await shell.perform([published()])
        await shell.drain_events(DRAINED_S)
        await shell.stop(1.0)
        return shell

    shell = asyncio.run(main())
    assert shell.events_dropped == 0 and shell.events_published == 2
    kinds = [type(m.event_decoder.decode(d)).__name__ for _, _, d in stream.messages]
    assert kinds == ["ShardStarted", "GroupsPublished"]  # the start's marker first


def test_a_request_refused_while_waiting_for_room_counts_its_event_dropped() -> None:
    stream = Stream()
    nc = Connection(stream)
    nc.up = False  # nothing leaves the outbox

    async def main() -> DirectoryShell:
        shell = shell_of(1, cast(Any, nc), outbox_max=1)
        await shell.start(cast(Any, nc))  # its marker: taken by the publisher, in flight
        await shell.perform([published()])  # fills the outbox
        waiting = asyncio.create_task(shell.perform([published()]))  # waits for room
        await asyncio.sleep(0.05)
        assert not waiting.done() and shell.events_dropped == 0
        await shell.stop(1.0)
        await asyncio.gather(waiting, return_exceptions=True)
        return shell

    shell = asyncio.run(main())
    assert shell.events_dropped == 3  # the marker in flight, the one queued, the one refused
    assert shell.events_published == 0 and stream.messages == []


def test_the_events_after_a_refused_one_in_its_effects_count_dropped_too() -> None:
    """`perform` ends at the first event refused (`WrongShard`): the events after it in the same
    effects list are not queued either, and count (review of the change: they went uncounted)."""
    stream = Stream()
    nc = Connection(stream)
    nc.up = False  # nothing leaves the outbox

    async def main() -> DirectoryShell:
        shell = shell_of(1, cast(Any, nc), outbox_max=1)
        await shell.start(cast(Any, nc))  # its marker: taken by the publisher, in flight
        await shell.perform([published()])  # fills the outbox
        waiting = asyncio.create_task(shell.perform([published(), published(), published()]))
        await asyncio.sleep(0.05)
        await shell.stop(1.0)
        await asyncio.gather(waiting, return_exceptions=True)
        return shell

    shell = asyncio.run(main())
    assert shell.events_dropped == 5  # the marker, the one queued, the three of the refused request

"""Repair and the disk tier's replicas, and a destination's `busy` (review, stop 65):
- an arena and a disk replica of an object on one segment are one replica: the scan counted them
  as two, so such an object was never repaired, and a drain dropped its copy on the draining
  segment, leaving it on one segment;
- a destination with no copy slot free (`busy`: a segment takes `KVF_SEGMENT_COPIES_MAX` at
  once) is no failed copy: three busy answers made an object STUCK for 10 minutes, and repair
  sent 8 copies at once to one segment."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvfabric.core.repair import RepairConfig, RepairCore, StartCopy
from kvfabric.format.errors import Busy, Unavailable
from kvfabric.format.ids import ChainHash, Namespace
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE
from kvfabric.repair.shell import RepairShell, now_ms

MB = 1 << 20


def segment(segment_id: str, host: str, *, draining: bool = False) -> m.SegmentInfo:
    return m.SegmentInfo(
        segment_id=segment_id,
        incarnation=1,
        domain=m.FailureDomain(host=host),
        up=True,
        draining=draining,
        capacity_bytes=1 << 30,
        reserved_bytes=0,
        reported_used_bytes=0,
        last_heartbeat_ms=0,
        data_addr="tcp://x:1",
    )


def replica(segment_id: str, slot: int) -> m.Replica:
    return m.Replica(segment_id=segment_id, incarnation=1, slot=slot, slot_generation=1)


class Directory:
    """One object (target 2) whose replicas are `replicas`; `replica_corrupt` asks recorded."""

    def __init__(self, segments: list[m.SegmentInfo], replicas: list[m.Replica]) -> None:
        self.segments_listed, self.replicas = segments, replicas
        self.asked: list[tuple[str, str]] = []

    async def segments(self, timeout_s: float) -> m.SegmentList:
        return m.SegmentList(epoch=1, segments=self.segments_listed)

    async def known_shards(self) -> int:
        return 1

    async def shard_pages(
        self, shard: int, query: Any, timeout_s: float, pages_max: int
    ) -> AsyncIterator[Any]:
        obj = m.ObjectLocation(
            chunk_index=0, member=m.Member(0, 0, 0), size_bytes=1024, checksum=b"", replicas=self.replicas
        )
        group = m.GroupSummary(
            group=ChainHash(b"c" * 32),
            namespace=Namespace(b"n" * 54),
            chunk_index=0,
            state="published",
            members=1,
            expected_members=1,
            objects=[obj],
        )
        yield m.GroupList(epoch=1, groups=[group])

    def shard_of(self, key: bytes) -> int:
        return 0

    async def ask(self, shard: int, verb: str, message: Any, timeout_s: float) -> Any:
        self.asked.append((verb, message.segment_id))
        assert verb == "replica_corrupt_many" and 1 <= len(message.items) <= m.REPLICA_BATCH_MAX
        return m.ReplicaCorruptManyReply(epoch=1, dropped=[True] * len(message.items))


def shell_over(directory: Directory) -> tuple[RepairShell, RepairCore]:
    core = RepairCore(RepairConfig())
    shell = RepairShell(
        core, replicas_target=2, scan_ms=1000, tick_ms=100, request_timeout_s=1, copy_timeout_s=1
    )
    shell._dir = lambda: directory  # type: ignore[assignment,method-assign,return-value]
    return shell, core


async def test_an_arena_and_a_disk_replica_on_one_segment_are_one_and_the_object_is_repaired() -> None:
    directory = Directory(
        [segment("s1", "h1"), segment("s2", "h2")], [replica("s1", 5), replica("s1", SSD_SLOT_BASE + 5)]
    )
    shell, core = shell_over(directory)
    await shell.scan()
    assert shell.below_target == 1
    (copy,) = core.tick(now_ms())
    assert isinstance(copy, StartCopy) and (copy.source, copy.destination) == ("s1", "s2")


async def test_a_drain_keeps_the_copy_of_an_object_whose_other_replicas_are_one_segments() -> None:
    draining = segment("s3", "h3", draining=True)
    replicas = [replica("s1", 5), replica("s1", SSD_SLOT_BASE + 5), replica("s3", 7)]
    directory = Directory([segment("s1", "h1"), segment("s2", "h2"), draining], replicas)
    shell, _ = shell_over(directory)
    await shell.scan()
    assert directory.asked == []  # s3's copy stays until the object has two segments elsewhere


async def test_busy_answers_never_make_an_object_stuck() -> None:
    core = RepairCore(RepairConfig(attempts_max=3, retry_backoff_ms=0))
    for segment_id, zone in (("a", "z1"), ("b", "z2")):
        core.segment_up(segment_id, incarnation=1, zone=zone, rack="r", host="h", free_bytes=100 * MB)
    core.object_known(b"o" * 96, size_bytes=MB, replica_target=2, segments=["a"])
    shell = RepairShell(
        core, replicas_target=2, scan_ms=1000, tick_ms=100, request_timeout_s=1, copy_timeout_s=1
    )

    async def busy(start: StartCopy) -> bool:
        raise Busy("copies in flight at their limit", limit=4)

    shell._copy_once = busy  # type: ignore[method-assign]
    for _ in range(5):  # more busy answers than attempts_max
        (start,) = core.tick(now_ms())
        assert isinstance(start, StartCopy)
        await shell._copy(start)
    assert core.counters["copies_busy_total"] == 5
    assert core.counters.get("objects_stuck_total", 0) == 0 and core.gauges()["objects_stuck"] == 0
    assert core.counters.get("copies_failed_total", 0) == 0


def test_copies_to_one_segment_are_capped_at_what_it_takes() -> None:
    core = RepairCore(RepairConfig(copies_per_destination_max=4, copies_in_flight_max=32))
    for segment_id, zone in (("a", "z1"), ("b", "z2")):
        core.segment_up(segment_id, incarnation=1, zone=zone, rack="r", host="h", free_bytes=100 * MB)
    for i in range(10):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a"])
    started = [e for e in core.tick(0) if isinstance(e, StartCopy)]
    assert len(started) == 4 and {s.destination for s in started} == {"b"}
    core.copy_ok(started[0].copy_id)
    assert len([e for e in core.tick(1) if isinstance(e, StartCopy)]) == 1
    core.check_invariants()


def test_the_cap_never_narrows_a_copys_failure_domain() -> None:
    """The best destination (another zone) at its cap: the copy waits a tick instead of going to
    a segment in the zone its surviving replica is in (placed there, it would stay there)."""
    core = RepairCore(RepairConfig(copies_per_destination_max=2, copies_in_flight_max=32))
    for segment_id, zone in (("a", "z1"), ("b", "z2"), ("a2", "z1")):
        core.segment_up(
            segment_id, incarnation=1, zone=zone, rack=segment_id, host=segment_id, free_bytes=100 * MB
        )
    for i in range(5):
        core.object_known(i, size_bytes=MB, replica_target=2, segments=["a"])
    started = [e for e in core.tick(0) if isinstance(e, StartCopy)]
    assert [s.destination for s in started] == ["b", "b"]  # not a2, in a's zone
    core.check_invariants()


class FailingAfterFirstPage(Directory):
    """The listing's first shard answers its page, the second fails (a failover)."""

    fail = True

    async def known_shards(self) -> int:
        return 2

    async def shard_pages(
        self, shard: int, query: Any, timeout_s: float, pages_max: int
    ) -> AsyncIterator[Any]:
        if shard == 1 and self.fail:
            raise Unavailable("shard 1 failing over")
        if shard == 0:
            async for page in super().shard_pages(shard, query, timeout_s, pages_max):
                yield page


async def test_an_object_seen_by_a_failed_pass_is_removed_when_a_later_pass_no_longer_lists_it() -> None:
    """A pass that failed part-way told the core of objects it never tracked: one that reached
    its target before the next good pass stayed in the core for good, counted, and a drain
    later recounted it from its stale view (review, stop 70)."""
    directory = FailingAfterFirstPage([segment("s1", "h1"), segment("s2", "h2")], [replica("s1", 5)])
    shell, core = shell_over(directory)
    with pytest.raises(Unavailable):
        await shell.scan()
    assert len(core._objects) == 1  # told of the object, below target
    directory.fail, directory.replicas = False, [replica("s1", 5), replica("s2", 6)]  # at target now
    await shell.scan()
    assert len(core._objects) == 0 and shell.below_target == 0


class ManyAtTarget(Directory):
    """`n` objects, each on s1 and s2 (at target) and on the draining s3."""

    def __init__(self, n: int) -> None:
        segs = [segment("s1", "h1"), segment("s2", "h2"), segment("s3", "h3", draining=True)]
        super().__init__(segs, [])
        self.n = n

    async def shard_pages(
        self, shard: int, query: Any, timeout_s: float, pages_max: int
    ) -> AsyncIterator[Any]:
        groups = []
        for i in range(self.n):
            reps = [replica("s1", i), replica("s2", i), replica("s3", i)]
            obj = m.ObjectLocation(
                chunk_index=0, member=m.Member(0, 0, 0), size_bytes=1024, checksum=b"", replicas=reps
            )
            groups.append(
                m.GroupSummary(
                    group=ChainHash(i.to_bytes(32, "big")),
                    namespace=Namespace(b"n" * 54),
                    chunk_index=0,
                    state="published",
                    members=1,
                    expected_members=1,
                    objects=[obj],
                )
            )
        yield m.GroupList(epoch=1, groups=groups)


async def test_a_drain_retires_replicas_in_batches() -> None:
    """One `replica_corrupt` a replica, one after another: a drain of a million replicas held
    the next pass (and every segment failure it would notice) for minutes (review, stop 70)."""
    directory = ManyAtTarget(2 * m.REPLICA_BATCH_MAX + 2)
    shell, _ = shell_over(directory)
    await shell.scan()
    assert directory.asked == [("replica_corrupt_many", "s3")] * 3
    assert shell.replicas_retired == 2 * m.REPLICA_BATCH_MAX + 2

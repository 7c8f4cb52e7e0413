"""A copy the repair core drops is cancelled, and the next copy of that object waits for it
(review, 2026-12-06): the shell's copies run against a real directory core, the destination
segments are fakes that confirm when the test lets them.

Before, a copy the core no longer wanted (the object back at its target another way) ran on and
its confirm added a replica past the target, kept until eviction; and a copy the core had
dropped that failed later aborted its ticket by key (`put_abort`), which also aborted the
ticket of the object's next copy (on another destination, or the same ticket on the same one),
so that copy failed too and repair of the object backed off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvfabric.cluster import replicas
from kvfabric.core.directory import DirectoryCore
from kvfabric.core.repair import RepairConfig, RepairCore, StartCopy
from kvfabric.format.errors import NotFound, Unavailable
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import CopyReply
from kvfabric.repair.shell import RepairShell, now_ms
from tests.unit.core.dirkit import confirm_ticket, groups, key, new_core, put

SEGMENTS = {"s1": "z1", "s2": "z2", "s3": "z3", "s4": "z4"}
SIZE = 100


@dataclass
class Job:
    """One `seg.copy` at a destination: it reads the bytes once the test opens `gate`, then
    confirms with the directory, whether or not its caller still waits (a copy thread)."""

    ticket: m.WriteTicket
    gate: asyncio.Future[None]
    task: asyncio.Task[CopyReply] = field(init=False)


class Cluster:
    """The directory core behind a fake router, and the segments' copies."""

    nc = None

    def __init__(self, directory: DirectoryCore) -> None:
        self.directory = directory
        self.jobs: list[Job] = []
        self.aborted = 0  # tickets put_abort took away
        self.abort_gate: asyncio.Future[None] | None = None  # set: put_abort waits for it

    def shard_of(self, key: bytes) -> int:
        return 0

    async def ask(self, shard: int, verb: str, message: Any, timeout_s: float) -> Any:
        await asyncio.sleep(0)  # a round trip
        if verb == "put_abort" and self.abort_gate is not None:
            await self.abort_gate
        reply = self.directory.handle(message, 0).reply
        if isinstance(reply, m.PutAbortReply):
            self.aborted += reply.aborted
        return reply

    async def request(self, nc: object, subject: str, message: Any, decoder: object, timeout_s: float) -> Any:
        job = Job(message.ticket, asyncio.get_running_loop().create_future())
        job.task = asyncio.create_task(self._copy_in(job, len(self.jobs)))
        job.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
        self.jobs.append(job)
        return await asyncio.shield(job.task)

    async def _copy_in(self, job: Job, slot: int) -> CopyReply:
        await job.gate
        reply = confirm_ticket(self.directory, job.ticket, slot, now=0).reply
        assert isinstance(reply, m.ConfirmReply)
        if reply.results[0].status != "ok":  # the segment frees what it wrote
            raise NotFound(f"confirm: {reply.results[0].status}")
        return CopyReply(slot=slot, slot_generation=1)

    def holders(self, k: bytes) -> list[str]:
        found = self.directory.published_table.published_member(k)
        assert found is not None
        return sorted(self.directory.segment_table.where(r.placement)[0] for r in found[2].replicas)

    def add_replica(self, k: ObjectKey, segment_id: str, writer_id: str) -> None:
        """Another writer (prefetch, say) copies `k` onto `segment_id`: a confirmed replica."""
        begin = self.directory.handle(
            m.ReplicateBegin(writer_id=writer_id, request_id="other", key=k, segment_id=segment_id), 0
        ).reply
        assert isinstance(begin, m.ReplicateBeginReply) and begin.ticket is not None
        confirm_ticket(self.directory, begin.ticket, 99, now=0)


MakeCluster = Callable[[int], tuple[Cluster, ObjectKey]]  # (the key's replicas) -> cluster, key


@pytest.fixture
async def cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[MakeCluster]:
    """Makes the cluster; afterwards every gate still shut is opened (a test that failed half way
    would leave a cancelled copy waiting for its abort forever, and the loop with it)."""
    made: list[Cluster] = []

    def make(replicas_default: int) -> tuple[Cluster, ObjectKey]:
        directory = new_core(replicas_default=replicas_default)
        for segment_id, zone in SEGMENTS.items():
            directory.handle(
                m.RegisterSegment(
                    segment_id=segment_id,
                    incarnation=1,
                    capacity_bytes=10_000,
                    domain=m.FailureDomain(host=segment_id, rack="r", zone=zone),
                    data_addr=f"tcp://{segment_id}:1",
                ),
                0,
            )
        (g,) = groups(1)
        k = key(g)
        assert put(directory, [k], size=SIZE).results[0].status == "published"
        made.append(Cluster(directory))
        monkeypatch.setattr(replicas, "request", made[-1].request)
        return made[-1], k

    yield make
    for c in made:
        for gate in [c.abort_gate, *(job.gate for job in c.jobs)]:
            if gate is not None and not gate.done():
                gate.set_result(None)
    await settle()


def repair_shell(cluster: Cluster, k: ObjectKey, target: int) -> tuple[RepairShell, RepairCore]:
    core = RepairCore(RepairConfig(retry_backoff_ms=0))
    for segment_id, zone in SEGMENTS.items():
        core.segment_up(segment_id, incarnation=1, zone=zone, rack="r", host=segment_id, free_bytes=10_000)
    core.object_known(k, size_bytes=SIZE, replica_target=target, segments=cluster.holders(k))
    shell = RepairShell(
        core, replicas_target=target, scan_ms=1000, tick_ms=100, request_timeout_s=1.0, copy_timeout_s=1.0
    )
    shell._router = cluster  # type: ignore[assignment]
    return shell, core


async def tick(shell: RepairShell) -> list[StartCopy]:
    effects = shell.core.tick(now_ms())
    for effect in effects:
        await shell._perform(effect)
    await settle()
    return [e for e in effects if isinstance(e, StartCopy)]


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def test_a_copy_the_core_no_longer_wants_is_cancelled_and_never_lands(
    cluster: MakeCluster,
) -> None:
    c, k = cluster(1)
    shell, core = repair_shell(c, k, target=2)
    (first,) = await tick(shell)
    (job,) = c.jobs  # the destination is reading the bytes
    # Meanwhile the object gets back to its target another way: another writer's replica on a
    # segment the copy does not touch; the scan finds it no longer below target.
    (elsewhere,) = sorted(set(SEGMENTS) - {*c.holders(k), first.destination})[:1]
    c.add_replica(k, elsewhere, writer_id="prefetch")
    core.object_removed(k)
    await tick(shell)  # the core's CancelCopy: the shell aborts the copy's ticket
    job.gate.set_result(None)  # the destination has the bytes and confirms
    await settle()
    assert first.destination not in c.holders(k), "a replica past the target"
    assert len(c.holders(k)) == 2 and c.aborted == 1
    assert not shell._copies and not shell._of_key  # every copy ended, nothing kept
    await shell.stop()


@pytest.mark.parametrize("dropped_by", ["destination_draining", "source_corrupt"])
async def test_a_dropped_copy_that_fails_later_does_not_abort_the_next_copy(
    cluster: MakeCluster, dropped_by: str
) -> None:
    c, k = cluster(2)
    shell, core = repair_shell(c, k, target=3)
    (first,) = await tick(shell)
    (old_job,) = c.jobs
    if dropped_by == "destination_draining":
        core.segment_draining(first.destination)
    else:
        core.replica_lost(k, first.source, corrupt=True)  # scrub: read the other replica
    (second,) = await tick(shell)
    # to another segment, or to the same one: `replicate_begin` hands out the same ticket then,
    # while the dropped copy's ticket is alive
    assert (second.destination == first.destination) == (dropped_by == "source_corrupt")
    assert len(c.jobs) == 2, "the next copy never reached its destination"
    old_job.gate.set_exception(Unavailable("the old copy fails at last"))
    await settle()
    c.jobs[1].gate.set_result(None)
    await settle()
    assert second.destination in c.holders(k), "the next copy's ticket was aborted"
    assert second.destination in core.replicas(k) and core.counters["copies_ok_total"] == 1
    assert not shell._copies and not shell._of_key  # every copy ended, nothing kept
    await shell.stop()


async def test_a_copy_waits_for_every_earlier_copy_of_its_object_not_only_the_last(
    cluster: MakeCluster,
) -> None:
    """A cancelled copy's abort is slow; the next copy, waiting for it, is cancelled too: the
    third one still waits for the first one's abort, else that abort takes its ticket."""
    c, k = cluster(2)
    shell, core = repair_shell(c, k, target=3)
    c.abort_gate = asyncio.get_running_loop().create_future()
    (first,) = await tick(shell)
    core.segment_draining(first.destination)
    (second,) = await tick(shell)  # waits for the first copy's abort
    core.replica_lost(k, second.source, corrupt=True)
    (third,) = await tick(shell)
    assert len(c.jobs) == 1, "a copy began while an earlier one's abort was on its way"
    c.abort_gate.set_result(None)
    await settle()
    (_, job) = c.jobs
    assert job.ticket.segment_id == third.destination
    job.gate.set_result(None)
    await settle()
    assert third.destination in c.holders(k) and third.destination in core.replicas(k)
    assert not shell._copies and not shell._of_key
    await shell.stop()


async def test_a_cancelled_copy_whose_abort_is_slow_does_not_abort_the_next_copy(
    cluster: MakeCluster,
) -> None:
    """The old copy's request failed and its `put_abort` is slow (the directory busy); the core
    drops the copy and starts the next one. The cancel must not end the old task before its
    abort is answered: an abort left to run on its own landed after the next copy's
    `replicate_begin` and aborted its ticket (review, 2026-12-06)."""
    c, k = cluster(2)
    shell, core = repair_shell(c, k, target=3)
    c.abort_gate = asyncio.get_running_loop().create_future()
    (first,) = await tick(shell)
    (old_job,) = c.jobs
    old_job.gate.set_exception(Unavailable("destination gone"))  # the copy fails: a slow abort starts
    await settle()
    core.segment_draining(first.destination)  # the core drops the copy
    (second,) = await tick(shell)  # CancelCopy(first), then StartCopy(second)
    await settle()
    c.abort_gate.set_result(None)  # the old copy's abort lands now
    await settle()
    if len(c.jobs) == 2:
        c.jobs[1].gate.set_result(None)
        await settle()
    assert second.destination in c.holders(k), "the old copy's abort killed the next copy's ticket"
    await shell.stop()


async def test_a_copy_cancelled_before_it_read_its_granted_ticket_aborts_it(cluster: MakeCluster) -> None:
    """The directory granted `replicate_begin` (a ticket, its reservation) but the copy was
    cancelled before it read the answer: the ticket is aborted at once, not left to its deadline
    (review, 2026-12-06: the abort covered only the segment's copy request)."""
    c, k = cluster(2)
    holders = c.holders(k)
    destination = next(s for s in SEGMENTS if s not in holders)
    answered = asyncio.get_running_loop().create_future()
    plain_ask = c.ask

    async def ask(shard: int, verb: str, message: Any, timeout_s: float) -> Any:
        if verb == "replicate_begin":
            reply = c.directory.handle(message, 0).reply  # granted ...
            await answered  # ... and the answer not read yet
            return reply
        return await plain_ask(shard, verb, message, timeout_s)

    c.ask = ask  # type: ignore[method-assign]
    copy = asyncio.create_task(
        replicas.copy_replica(
            c,  # type: ignore[arg-type]
            key=k,
            destination=destination,
            writer_id="repair",
            request_id="copy-1",
            timeout_s=5.0,
        )
    )
    await settle()
    copy.cancel()
    with pytest.raises(asyncio.CancelledError):
        await copy
    assert c.aborted == 1, "the granted ticket was left to its deadline"

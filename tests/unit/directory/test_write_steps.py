"""Issue 21 item 2 at the directory shell, without NATS: a put_commit, put_abort or evict of 4,096 ids runs
as the core's steps of `WRITE_SLICE_IDS` (`DirectoryShell._in_steps`), the event loop yielded
between, so another tenant's lookup that arrives meanwhile is answered before it ends; no core
call does more than one slice's work (what the stall metric times); a shard lost between two
steps ends it `wrong_shard`; `write_slice_ids=0` runs it whole."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import msgspec
import pytest

from kvfabric.core.directory import DirectoryCore, FreeSlots
from kvfabric.directory.shell import WRITE_SLICE_IDS, WRITE_WHOLE_IDS_MAX, DirectoryShell
from kvfabric.directory.stalls import CORE_CALLS
from kvfabric.format.errors import WrongShard
from kvfabric.format.ids import GroupId, ObjectKey, pack_object_key
from kvfabric.proto import directory as m
from kvfabric.proto.tickets import write_receipt
from tests.unit.core import dirkit
from tests.unit.core.dirkit import SECRET, spec
from tests.unit.directory.test_shell_side_channels import ALICE, BOB, ids, new_core, publish

T = TypeVar("T")
BIG = m.PUT_BATCH_OBJECTS_MAX  # 4,096


class QuietShell(DirectoryShell):
    """No NATS: frees are not sent (the core retries them on a tick, never run here)."""

    async def _free(self, effect: FreeSlots) -> None:
        return None


def shell_of(core: DirectoryCore, write_slice_ids: int = WRITE_SLICE_IDS) -> QuietShell:
    return QuietShell(
        core,
        tick_ms=100,
        events_outbox_max=1 << 20,  # a 4,096-group evict queues 4,096 events (nobody publishes here)
        events_max_age_s=60,
        free_timeout_s=1,
        write_slice_ids=write_slice_ids,
    )


def begun(core: DirectoryCore, groups: list[GroupId]) -> m.PutCommit:
    """`groups` begun (256 a request) and their put_commit carrying a receipt a replica."""
    keys: list[ObjectKey] = [pack_object_key(g, 0, 0, 0) for g in groups]
    receipts: list[m.WriteReceipt] = []
    for start in range(0, len(keys), 256):
        begin = m.PutBegin(
            writer_id="w", request_id=f"b{start}", objects=[spec(k) for k in keys[start : start + 256]]
        )
        reply = core.handle(begin, 0).reply
        assert isinstance(reply, m.PutBeginReply)
        for i, r in enumerate(reply.results, start):
            assert r.status == "placed"
            receipts += [m.WriteReceipt(t.ticket_id, i, 1, write_receipt(SECRET, t, i, 1)) for t in r.tickets]
    return m.PutCommit(writer_id="w", request_id="c", keys=keys, receipts=receipts)


def setup() -> tuple[DirectoryCore, list[GroupId], list[GroupId], m.PutCommit]:
    core = new_core()
    alice = ids(ALICE, 4, seed=1)
    publish(core, alice)
    bob = ids(BOB, BIG, seed=2)
    return core, alice, bob, begun(core, bob)


class Work:
    """Per core call (`CORE_CALLS.timed`): how many groups it published or evicted, or how many
    objects being written it began or aborted."""

    def __init__(self, core: DirectoryCore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int]] = []
        timed = CORE_CALLS.timed

        def counted(what: str, call: Callable[[], T]) -> T:
            before = len(core.published), core.pending_objects
            try:
                return timed(what, call)
            finally:
                changed = abs(len(core.published) - before[0]) + abs(core.pending_objects - before[1])
                self.calls.append((what, changed))

        monkeypatch.setattr(CORE_CALLS, "timed", counted)

    def of(self, what: str) -> list[int]:
        return [n for w, n in self.calls if w == what]


async def lookup_between(
    shell: DirectoryShell, request: msgspec.Struct, alice: list[GroupId]
) -> msgspec.Struct:
    """`request` started; alice's lookup, sent once its first step ran, is answered before it ends."""
    task = asyncio.create_task(shell.handle(request))
    await asyncio.sleep(0)  # the request's first step ran; it yields the loop after each
    reply = await shell.handle(m.Lookup(holder_id="a", groups=alice))
    assert isinstance(reply, m.LookupReply) and reply.hit_chunks == len(alice)
    assert not task.done(), "the lookup waited for the whole request"
    await shell.handle(m.LeaseRelease(holder_id="a", lease_id=reply.lease_id))
    return await task


def test_a_max_size_commit_and_evict_run_in_steps_and_a_lookup_is_answered_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core, alice, bob, commit = setup()
    shell = shell_of(core)
    work = Work(core, monkeypatch)

    async def go() -> tuple[msgspec.Struct, msgspec.Struct]:
        committed = await lookup_between(shell, commit, alice)
        evicted = await lookup_between(shell, m.Evict(groups=bob, reason="test"), alice)
        return committed, evicted

    committed, evicted = asyncio.run(go())
    assert isinstance(committed, m.PutCommitReply) and isinstance(evicted, m.EvictReply)
    assert [r.status for r in committed.results] == ["published"] * BIG
    assert [r.status for r in evicted.results] == ["evicting"] * BIG
    # each core call published or evicted one slice at most: 64 of them did the 4,096 (whole:
    # one call of 4,096 each)
    for what in ("PutCommit", "Evict"):
        assert max(work.of(what)) <= 2 * WRITE_SLICE_IDS  # a commit's slice: 64 out of pending, 64 published
        assert sum(n > 0 for n in work.of(what)) == BIG // WRITE_SLICE_IDS
    core.check_invariants()


def test_a_max_size_abort_runs_in_steps_and_a_lookup_is_answered_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core, alice, _, commit = setup()
    shell = shell_of(core)
    work = Work(core, monkeypatch)
    abort = m.PutAbort(writer_id="w", request_id="a", keys=commit.keys)
    reply = asyncio.run(lookup_between(shell, abort, alice))
    assert isinstance(reply, m.PutAbortReply) and reply.aborted == BIG
    assert core.pending_objects == 0
    assert max(work.of("PutAbort")) == WRITE_SLICE_IDS
    assert sum(n > 0 for n in work.of("PutAbort")) == BIG // WRITE_SLICE_IDS
    core.check_invariants()


def test_a_shard_lost_between_steps_ends_the_request() -> None:
    core, alice, _, commit = setup()
    shell = shell_of(core)

    async def go() -> None:
        task = asyncio.create_task(shell.handle(commit))
        await asyncio.sleep(0)  # its first step ran
        shell.may_act = lambda: False  # the lease lapsed: no further step
        with pytest.raises(WrongShard):
            await task

    asyncio.run(go())
    assert not core.published.keys() - {g[4:20] + g[58:90] for g in alice}  # nothing of bob's published
    core.check_invariants()


def test_a_write_slice_of_zero_runs_the_request_whole() -> None:
    core, alice, _, commit = setup()
    shell = shell_of(core, write_slice_ids=0)

    async def go() -> bool:
        task = asyncio.create_task(shell.handle(commit))
        await asyncio.sleep(0)
        return task.done()

    assert asyncio.run(go())  # done within one turn of the loop: one core call
    assert len(core.published) == len(alice) + BIG


def test_a_client_sized_commit_runs_whole_and_publishes_one_event() -> None:
    """Review of 71ae4e6: the client's own put_commit of 256 keys ran in 4 steps and published 4
    `GroupsPublished` events instead of one (issue 20's one event per commit); it runs whole."""
    core = new_core()
    commit = begun(core, ids(BOB, WRITE_WHOLE_IDS_MAX, seed=3))
    shell = shell_of(core)

    async def go() -> tuple[bool, msgspec.Struct]:
        task = asyncio.create_task(shell.handle(commit))
        await asyncio.sleep(0)
        done = task.done()
        return done, await task

    done, reply = asyncio.run(go())
    assert done  # one core call, no yield between steps
    assert isinstance(reply, m.PutCommitReply)
    assert [r.status for r in reply.results] == ["published"] * WRITE_WHOLE_IDS_MAX
    events = [msgspec.msgpack.decode(raw) for _, raw, _ in list(shell._outbox._queue)]  # type: ignore[attr-defined]
    assert len(events) == 1, len(events)
    core.check_invariants()


def test_a_client_sized_commit_at_two_replicas_runs_whole_too() -> None:
    """Review of 0b40369: at 2 replicas the client's 256-key commit carries 512 receipts; its
    receipts count per replica, so it is still one batch, run whole: one published event."""
    core = dirkit.new_core(replicas_default=2)
    for name in ("s1", "s2", "s3"):
        dirkit.register(core, name, capacity=1 << 30, host=name, rack=name)
    keys = [dirkit.key(g) for g in dirkit.groups(WRITE_WHOLE_IDS_MAX, seed=41)]
    begun = core.handle(m.PutBegin(writer_id="w", request_id="b", objects=[spec(k) for k in keys]), 0).reply
    assert isinstance(begun, m.PutBeginReply)
    receipts = [
        m.WriteReceipt(t.ticket_id, 2 * i + j, 1, write_receipt(SECRET, t, 2 * i + j, 1))
        for i, r in enumerate(begun.results)
        for j, t in enumerate(r.tickets)
    ]
    assert len(receipts) == 2 * len(keys)
    shell = shell_of(core)
    reply = asyncio.run(
        shell.handle(m.PutCommit(writer_id="w", request_id="c", keys=keys, receipts=receipts))
    )
    assert isinstance(reply, m.PutCommitReply)
    assert [r.status for r in reply.results] == ["published"] * len(keys)
    events = [msgspec.msgpack.decode(raw) for _, raw, _ in list(shell._outbox._queue)]  # type: ignore[attr-defined]
    assert len([e for e in events if e.get("t") == "dir.ev.published_many.v1"]) == 1
    core.check_invariants()

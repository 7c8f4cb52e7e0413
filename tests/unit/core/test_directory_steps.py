"""A put_begin, put_commit or evict run as the core's steps (`DirectoryCore.steps`, issue 21
item 2): the same reply and state as the request whole, every whole-request refusal before
anything is applied, and what runs between two steps seen by the later ones as if it had run
first."""

from __future__ import annotations

import msgspec
import pytest

from kvfabric.core.directory import DirectoryCore, Effect, Outcome
from kvfabric.core.directory.base import run_whole
from kvfabric.format.errors import BadRequest, Busy
from kvfabric.format.ids import GROUP_ID_BYTES, GroupId, ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.tickets import write_receipt
from tests.unit.core.dirkit import SECRET, groups, key, new_core, register, spec

STEP = 4


def core_with(n: int, seed: int) -> tuple[DirectoryCore, list[ObjectKey]]:
    core = new_core(replicas_default=1)
    register(core, "s1", capacity=1 << 30)
    register(core, "s2", capacity=1 << 30)
    return core, [key(g) for g in groups(n, seed=seed)]


def begun(core: DirectoryCore, keys: list[ObjectKey]) -> m.PutCommit:
    """`keys` begun, and their put_commit carrying a receipt a replica."""
    reply = core.handle(m.PutBegin(writer_id="w", request_id="b", objects=[spec(k) for k in keys]), 0).reply
    assert isinstance(reply, m.PutBeginReply)
    receipts = [
        m.WriteReceipt(t.ticket_id, i, 1, write_receipt(SECRET, t, i, 1))
        for i, r in enumerate(reply.results)
        for t in r.tickets
    ]
    return m.PutCommit(writer_id="w", request_id="c", keys=keys, receipts=receipts)


def twins(n: int, seed: int) -> tuple[DirectoryCore, DirectoryCore, list[ObjectKey]]:
    a, keys = core_with(n, seed)
    b, _ = core_with(n, seed)
    return a, b, keys


def state(core: DirectoryCore) -> tuple[object, ...]:
    return (
        sorted(core.published),
        sorted(core.building),
        core.pending_objects,
        sorted((s.segment_id, s.reserved_bytes) for s in core.segments.values()),
        dict(core.counters),
    )


def published_groups(effects: list[Effect]) -> list[bytes]:
    return [
        g.group
        for e in effects
        if isinstance(e.event, m.GroupsPublished)  # type: ignore[union-attr]
        for g in e.event.groups  # type: ignore[union-attr]
    ]


def run_all(core: DirectoryCore, keys: list[ObjectKey], ids_max: int | None) -> list[object]:
    """put_begin, put_commit (with receipts) and evict of `keys`, whole or in steps: each reply
    and the groups published, in order."""

    def run(request: msgspec.Struct) -> Outcome:
        return core.handle(request, 0) if ids_max is None else run_whole(core.steps(request, 0, ids_max))

    begin = run(m.PutBegin(writer_id="w", request_id="b", objects=[spec(k) for k in keys]))
    assert isinstance(begin.reply, m.PutBeginReply)
    assert {r.status for r in begin.reply.results} == {"placed"}
    receipts = [
        m.WriteReceipt(t.ticket_id, i, 1, write_receipt(SECRET, t, i, 1))
        for i, r in enumerate(begin.reply.results)
        for t in r.tickets
    ]
    commit = run(m.PutCommit(writer_id="w", request_id="c", keys=keys, receipts=receipts))
    assert isinstance(commit.reply, m.PutCommitReply)
    assert {r.status for r in commit.reply.results} == {"published"}
    core.check_invariants()
    evicted = run(m.Evict(groups=[GroupId(k[:GROUP_ID_BYTES]) for k in keys], reason="test"))
    assert isinstance(evicted.reply, m.EvictReply)
    assert {r.status for r in evicted.reply.results} == {"evicting"}
    core.check_invariants()
    return [begin.reply, commit.reply, published_groups(commit.effects), evicted.reply]


def test_each_verb_in_steps_answers_and_leaves_what_it_does_whole() -> None:
    """put_begin, put_commit (with receipts) and evict of 10 ids in steps of 4: the same replies,
    the same groups published in the same order, the same state as each whole."""
    whole, stepped, keys = twins(10, seed=3)
    assert run_all(whole, keys, None) == run_all(stepped, keys, STEP)
    assert state(whole) == state(stepped)


@pytest.mark.parametrize("ids_max", [None, 1])
@pytest.mark.parametrize("verb", ["put_begin", "put_commit", "put_abort", "evict"])
def test_a_malformed_id_in_the_last_slice_refuses_the_request_whole(verb: str, ids_max: int | None) -> None:
    """Every id is parsed before the first is applied: a bad one at the end refuses the request
    with nothing placed, committed or evicted, whole (`handle`; an evict used to evict the
    groups before the bad id and drop their frees) or in steps alike."""
    core, keys = core_with(10, seed=5)
    commit = begun(core, keys[:6])
    first = msgspec.structs.replace(commit, request_id="c0", keys=keys[:3], receipts=commit.receipts[:3])
    committed = core.handle(first, 0).reply
    assert isinstance(committed, m.PutCommitReply)
    assert [r.status for r in committed.results] == ["published"] * 3
    before = state(core)
    bad = ObjectKey(b"\x00" * 12)
    request: msgspec.Struct
    if verb == "put_begin":
        request = m.PutBegin(
            writer_id="w", request_id="b2", objects=[spec(k) for k in keys[6:]] + [spec(bad)]
        )
    elif verb == "put_commit":
        request = msgspec.structs.replace(commit, keys=[*keys[3:6], bad])
    elif verb == "put_abort":
        request = m.PutAbort(writer_id="w", request_id="a", keys=[*keys[3:6], bad])
    else:
        request = m.Evict(groups=[GroupId(k[:GROUP_ID_BYTES]) for k in keys[:3]] + [GroupId(b"x" * 10)])
    with pytest.raises(BadRequest):
        core.handle(request, 0) if ids_max is None else run_whole(core.steps(request, 0, ids_max))
    assert state(core)[:4] == before[:4]
    core.check_invariants()


def test_an_abort_in_steps_answers_and_leaves_what_it_does_whole() -> None:
    whole, stepped, keys = twins(10, seed=11)
    replies = []
    for core, ids_max in ((whole, None), (stepped, STEP)):
        begun(core, keys)
        abort = m.PutAbort(writer_id="w", request_id="a", keys=keys)
        outcome = core.handle(abort, 0) if ids_max is None else run_whole(core.steps(abort, 0, ids_max))
        assert isinstance(outcome.reply, m.PutAbortReply) and outcome.reply.aborted == len(keys)
        assert core.pending_objects == 0
        core.check_invariants()
        replies.append(outcome.reply)
    assert replies[0] == replies[1]
    assert state(whole) == state(stepped)


def test_a_begin_in_steps_sees_what_ran_between_them() -> None:
    """A chain hash another writer began under another identity between two steps of a
    put_begin is `in_flight` for that object (whole, the request would have been refused
    before placing anything; in steps, the earlier objects are placed and stay so)."""
    core, keys = core_with(3, seed=7)
    a = keys[2]
    other_model = ObjectKey(a[:20] + bytes(b ^ 0xFF for b in a[20:36]) + a[36:])  # same domain and chain
    steps = core.steps(m.PutBegin(writer_id="w", request_id="b", objects=[spec(k) for k in keys]), 0, 2)
    next(steps)
    next(steps)  # the objects validated
    next(steps)  # checked whole, the first two placed
    meanwhile = core.handle(m.PutBegin(writer_id="x", request_id="o", objects=[spec(other_model)]), 0).reply
    assert isinstance(meanwhile, m.PutBeginReply) and meanwhile.results[0].status == "placed"
    next(steps)
    with pytest.raises(StopIteration) as done:
        next(steps)
    reply = done.value.value
    assert isinstance(reply, m.PutBeginReply)
    assert [r.status for r in reply.results] == ["placed", "placed", "in_flight"]
    assert reply.results[2].deadline_ms == meanwhile.results[0].deadline_ms
    core.check_invariants()
    # the reply is remembered once the last object is placed: a retry gets it again
    again = core.handle(m.PutBegin(writer_id="w", request_id="b", objects=[spec(k) for k in keys]), 0).reply
    assert again == reply


def test_a_commit_in_steps_applies_every_receipt_before_its_first_commit() -> None:
    """All receipts, then the commits (as whole): a key of the first slice whose receipt is in
    the last slice of receipts still publishes."""
    core, keys = core_with(9, seed=9)
    commit = begun(core, keys)
    commit = msgspec.structs.replace(commit, receipts=list(reversed(commit.receipts)))
    outcome = run_whole(core.steps(commit, 0, STEP))
    assert isinstance(outcome.reply, m.PutCommitReply)
    assert [r.status for r in outcome.reply.results] == ["published"] * 9
    core.check_invariants()


def _two_begins(limit: str) -> tuple[DirectoryCore, m.PutBegin, m.PutBegin]:
    core = new_core(replicas_default=1, **{limit: 100})
    register(core, "s1", capacity=1 << 30)
    first = m.PutBegin(writer_id="t1/w1", request_id="a", objects=[spec(key(g)) for g in groups(80, seed=1)])
    second = m.PutBegin(writer_id="t1/w2", request_id="b", objects=[spec(key(g)) for g in groups(80, seed=2)])
    return core, first, second


@pytest.mark.parametrize("limit", ["tenant_pending_objects_max", "pending_objects_max"])
def test_begins_in_steps_at_once_share_the_pending_bounds(limit: str) -> None:
    """Review finding: the bounds were checked for the whole request but not held, so a second
    put_begin run between two steps of the first passed a bound only one of them fits in (160
    pending of 100). What the first was admitted for stays reserved until its slices are placed."""
    core, first, second = _two_begins(limit)
    steps = core.steps(first, 0, 8)
    for _ in range(80 // 8 + 1):  # its objects validated, its bounds checked, its first slice placed
        next(steps)
    core.check_invariants()  # suspended between steps: its reservation held
    assert core.write_table.reserved_objects == 80 - 8
    with pytest.raises(Busy):
        run_whole(core.steps(second, 0, 8))
    reply = run_whole(steps).reply
    assert isinstance(reply, m.PutBeginReply) and all(r.status == "placed" for r in reply.results)
    assert core.pending_objects == 80
    assert core.write_table.reserved_objects == 0 and not core.write_table.scope_reserved_objects
    assert not core.write_table.scope_reserved_bytes


def test_a_begin_in_steps_ended_early_gives_its_reservation_back() -> None:
    core, first, second = _two_begins("pending_objects_max")
    steps = core.steps(first, 0, 8)
    for _ in range(80 // 8 + 2):  # two slices placed
        next(steps)
    steps.close()  # the shell stops it (wrong_shard, a cancelled request)
    core.check_invariants()
    assert core.pending_objects == 16
    assert core.write_table.reserved_objects == 0 and not core.write_table.scope_reserved_objects
    reply = run_whole(core.steps(second, 0, 8)).reply  # 16 + 80 fit in 100
    assert isinstance(reply, m.PutBeginReply) and all(r.status == "placed" for r in reply.results)

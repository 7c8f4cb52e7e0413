"""The client's save table, as short scripts of events with the effects expected inline: the
decisions of one save (what is begun, written, committed, aborted) without any I/O."""

from __future__ import annotations

import pytest

from kvfabric.client.hits import SaveResult
from kvfabric.client.save_table import (
    Effect,
    Finished,
    PrepareBegins,
    SaveBatches,
    SaveTable,
    SendAbort,
    SendBegin,
    SendCommit,
    Write,
    WriteReplicas,
)
from kvfabric.client.save_table_events import (
    BeginAnswered,
    EndAnswered,
    Open,
    Prepared,
    SaveEvent,
    ShardMapUnknown,
    WritesDone,
)
from kvfabric.core.step import Core
from kvfabric.format.ids import ChainHash, ObjectKey
from kvfabric.format.invariant import InvariantViolation
from kvfabric.proto import directory as m
from tests.unit.client.test_save_table_machine import save_plan, shard_of

BATCHES = SaveBatches(begin=8, commit=8, abort=8)


def table(chunks: int, members: int = 1) -> SaveTable:
    return SaveTable(save_plan(chunks, members), shard_of, 4, 1000, BATCHES)


def ticket(key: ObjectKey, ticket_id: int, segment: str = "seg-a") -> m.WriteTicket:
    return m.WriteTicket(
        ticket_id=ticket_id,
        key=key,
        segment_id=segment,
        incarnation=1,
        size_bytes=1,
        checksum=b"",
        writer_id="w",
        deadline_ms=0,
        epoch=1,
    )


def placed(key: ObjectKey, *tickets: m.WriteTicket) -> m.BeginResult:
    return m.BeginResult(key=key, status="placed", tickets=list(tickets))


def begun(t: SaveTable, now_ms: int = 0) -> list[SendBegin]:
    assert t.step(Open(), now_ms) == [PrepareBegins()]
    effects = t.step(Prepared(tuple(b"d" for _ in t.plan.keys)), now_ms)
    assert all(isinstance(e, SendBegin) for e in effects)
    t.check_invariants()
    return effects  # type: ignore[return-value]


def test_a_save_begins_writes_every_replica_and_commits_with_the_receipts() -> None:
    t = table(2)  # keys k0 (shard 0) and k1 (shard 1): one begin per shard
    k0, k1 = t.plan.keys
    assert begun(t, 10) == [
        SendBegin(1, 0, (m.ObjectSpec(key=k0, size_bytes=1, checksum=b"d", parent=ChainHash(b"")),), 1010),
        SendBegin(2, 1, (m.ObjectSpec(key=k1, size_bytes=4, checksum=b"d", parent=ChainHash(b"")),), 1010),
    ]
    reply0 = m.PutBeginReply(epoch=1, results=[placed(k0, ticket(k0, 1), ticket(k0, 2, "seg-b"))])
    assert t.step(BeginAnswered(1, reply0, "trace-a"), 11) == []  # the other begin is outstanding
    reply1 = m.PutBeginReply(epoch=1, results=[placed(k1, ticket(k1, 3))])
    writes = (
        Write(k0, ticket(k0, 1), "trace-a", 1),
        Write(k0, ticket(k0, 2, "seg-b"), "trace-a", 1),
        Write(k1, ticket(k1, 3), "trace-b", 1),
    )
    assert t.step(BeginAnswered(2, reply1, "trace-b"), 12) == [WriteReplicas(writes)]
    receipt = m.WriteReceipt(1, 5, 1, b"mac")
    # k0: one replica of two written (committed: degraded, repair tops it up); k1: none (aborted)
    ends = t.step(WritesDone((("ok", receipt), ("segment_down", None), ("timeout", None))), 20)
    assert ends == [SendAbort(3, 1, (k1,), 1020), SendCommit(4, 0, ((k0, (receipt,)),), 1020)]
    t.check_invariants()
    assert t.step(EndAnswered(3, m.PutAbortReply(epoch=1, aborted=1)), 21) == []
    commit = m.PutCommitReply(epoch=1, results=[m.CommitResult(key=k0, status="degraded")])
    result = SaveResult(chunks_saved=1, chunks_failed=1, bytes_written=1, causes={"timeout": 1})
    assert t.step(EndAnswered(4, commit), 22) == [Finished(result)]
    t.check_invariants()
    assert t.state == "done" and t.result == result


def test_a_key_committed_missing_is_aborted_before_the_save_ends() -> None:
    """A commit answered `missing` (no replica confirmed: the segment lost before the commit, a
    receipt refused) leaves the key placed at the directory under this writer: every writer's
    put_begin of it, this one's next save's included, got `in_flight` until the write TTL
    (review, stop 68). It is aborted, not awaited: the save ends with it."""
    t = table(2)
    k0, k1 = t.plan.keys
    b0, b1 = begun(t, 10)
    t.step(BeginAnswered(b0.request, m.PutBeginReply(epoch=1, results=[placed(k0, ticket(k0, 1))]), "t"), 11)
    writes = t.step(
        BeginAnswered(b1.request, m.PutBeginReply(epoch=1, results=[placed(k1, ticket(k1, 2))]), "t"), 12
    )
    assert len(writes) == 1 and isinstance(writes[0], WriteReplicas)
    receipt = m.WriteReceipt(1, 5, 1, b"mac")
    commits = t.step(WritesDone((("ok", receipt), ("ok", receipt))), 20)
    assert [type(e) for e in commits] == [SendCommit, SendCommit]
    c0, c1 = (e.request for e in commits if isinstance(e, SendCommit))
    published = m.PutCommitReply(epoch=1, results=[m.CommitResult(key=k0, status="published")])
    assert t.step(EndAnswered(c0, published), 21) == []
    missing = m.PutCommitReply(epoch=1, results=[m.CommitResult(key=k1, status="missing")])
    result = SaveResult(chunks_saved=1, chunks_failed=1, bytes_written=5, causes={"missing": 1})
    done = t.step(EndAnswered(c1, missing), 22)
    # the abort is not awaited (its answer changes nothing): the save ends with it
    assert done == [SendAbort(c1 + 1, 1, (k1,), 1022), Finished(result)] and not t.awaits(c1 + 1)
    t.check_invariants()


def test_nothing_from_the_first_not_admitted_chunk_on_is_written_and_it_is_all_aborted() -> None:
    t = table(3)
    k0, k1, k2 = t.plan.keys
    begins = begun(t)
    assert [e.shard for e in begins] == [0, 1]  # k0, k2 on shard 0; k1 on shard 1
    both = m.PutBeginReply(epoch=1, results=[placed(k0, ticket(k0, 1)), placed(k2, ticket(k2, 2))])
    assert t.step(BeginAnswered(1, both, "t"), 0) == []
    not_admitted = m.BeginResult(key=k1, status="not_admitted")
    effects = t.step(BeginAnswered(2, m.PutBeginReply(epoch=1, results=[not_admitted]), "t"), 0)
    assert effects == [WriteReplicas((Write(k0, ticket(k0, 1), "t", 2),))]  # k2 is past chunk 1
    ends = t.step(WritesDone((("ok", None),)), 0)
    assert ends == [SendAbort(3, 0, (k2,), 1000), SendCommit(4, 0, ((k0, ()),), 1000)]
    t.step(EndAnswered(3, "directory_timeout"), 0)  # a lost abort: expires at the directory
    published = m.PutCommitReply(epoch=1, results=[m.CommitResult(key=k0, status="published")])
    result = SaveResult(chunks_saved=1, chunks_failed=2, bytes_written=1, causes={"not_admitted": 2})
    assert t.step(EndAnswered(4, published), 0) == [Finished(result)]


def test_a_begin_without_a_reply_fails_its_chunks_and_nothing_is_written_or_ended() -> None:
    t = table(1)
    begun(t)
    result = SaveResult(chunks_failed=1, causes={"directory_timeout": 1})
    assert t.step(BeginAnswered(1, "directory_timeout", "t"), 5) == [Finished(result)]
    t.check_invariants()


def test_a_second_answer_is_ignored_and_counted() -> None:
    t = table(1)
    begun(t)
    (k0,) = t.plan.keys
    exists = m.PutBeginReply(epoch=1, results=[m.BeginResult(key=k0, status="exists")])
    assert t.step(BeginAnswered(1, exists, "t"), 0) == [Finished(SaveResult(chunks_existing=1))]
    assert t.step(BeginAnswered(1, exists, "t"), 0) == []
    assert t.counters == {"answers_unknown_total": 1}


def test_an_empty_save_and_one_without_a_shard_map_end_before_any_request() -> None:
    empty = table(0)
    assert empty.step(Open(), 0) == [Finished(SaveResult(), begun=False)]
    t = table(2)
    assert t.step(Open(), 0) == [PrepareBegins()]
    failed = SaveResult(chunks_failed=2, causes={"directory_unavailable": 2})
    assert t.step(ShardMapUnknown(), 0) == [Finished(failed, begun=False)]


def test_caller_bugs_are_refused() -> None:
    t = table(1)
    with pytest.raises(InvariantViolation, match="out of its phase"):
        t.step(WritesDone(()), 0)
    begun(t, 10)
    with pytest.raises(InvariantViolation, match="time went backwards"):
        t.step(BeginAnswered(1, "busy", "t"), 9)
    t2 = table(2)
    t2.step(Open(), 0)
    with pytest.raises(InvariantViolation, match="one digest per object"):
        t2.step(Prepared((b"d",)), 0)


def test_the_save_table_has_the_one_core_shape() -> None:
    """`SaveTable` is a `Core[SaveEvent, Effect]` (mypy checks the assignment in `make lint`), like
    `LoadTable`: the shell steps events with its clock and performs the effects."""
    core: Core[SaveEvent, Effect] = table(1)
    assert core.step(Open(), 10) == [PrepareBegins()]
    core.check_invariants()


def test_an_abandoned_save_aborts_what_was_placed_and_not_yet_ended() -> None:
    """`abandon` (the save cancelled): one abort per shard batch of every key a begin answer
    placed and no commit or abort carried yet; the table is abandoned, without a result. A begin
    still out then stays outstanding: its answer (its request went) gives the aborts of what it
    placed (before, they were left reserved until the write TTL); a second answer is ignored
    (counted)."""
    t = table(3)
    k0, k1, k2 = t.plan.keys
    first, second = begun(t)
    assert (first.shard, second.shard) == (0, 1)  # k0, k2 on shard 0; k1 on shard 1
    reply = m.PutBeginReply(epoch=1, results=[placed(s.key, ticket(s.key, 1)) for s in first.specs])
    assert t.step(BeginAnswered(first.request, reply, "t"), 1) == []  # the other begin still out
    assert t.abandon(5) == [SendAbort(3, 0, (k0, k2), 1005)]
    t.check_invariants()
    assert t.state == "abandoned" and t.result is None
    late = m.PutBeginReply(epoch=1, results=[placed(k1, ticket(k1, 2)), placed(k0, ticket(k0, 3))])
    assert t.step(BeginAnswered(second.request, late, "t"), 6) == [SendAbort(4, 1, (k1,), 1006)]
    t.check_invariants()  # every placed key ended exactly once
    assert t.step(BeginAnswered(second.request, late, "t"), 7) == []
    assert t.counters["answers_unknown_total"] == 1
    with pytest.raises(InvariantViolation, match="abandon after the save ended"):
        t.abandon(8)


def test_a_late_begin_answer_of_an_abandoned_save_aborts_only_what_it_placed() -> None:
    """A begin answered after `abandon` with a cause, or with keys that exist or were refused:
    nothing to abort; a commit's answer after `abandon` is ignored (its request went: `abandon`
    counted its keys ended)."""
    t = table(3)
    _, k1, _ = t.plan.keys
    first, second = begun(t)
    assert t.abandon(1) == []  # nothing answered yet
    assert t.step(BeginAnswered(first.request, "directory_timeout", "t"), 2) == []
    refused = [m.BeginResult(key=k1, status="exists")]
    assert t.step(BeginAnswered(second.request, m.PutBeginReply(epoch=1, results=refused), "t"), 3) == []
    t.check_invariants()
    t2 = table(1)
    (send,) = begun(t2)
    (k,) = t2.plan.keys
    reply = m.PutBeginReply(epoch=1, results=[placed(k, ticket(k, 1))])
    assert t2.step(BeginAnswered(send.request, reply, "t"), 1) == [
        WriteReplicas((Write(k, ticket(k, 1), "t", 1),))
    ]
    (commit,) = t2.step(WritesDone((("ok", None),)), 2)
    assert isinstance(commit, SendCommit)
    assert t2.abandon(3) == []  # the commit goes even so (the shell lets it)
    assert t2.step(EndAnswered(commit.request, "late"), 4) == []
    assert t2.counters["answers_unknown_total"] == 1
    t2.check_invariants()


def test_an_abandoned_save_never_aborts_a_key_already_committed_or_aborted() -> None:
    t = table(2)
    for send in begun(t):
        reply = m.PutBeginReply(epoch=1, results=[placed(s.key, ticket(s.key, 1)) for s in send.specs])
        t.step(BeginAnswered(send.request, reply, "t"), 1)
    assert t.state == "writing"
    t.step(WritesDone((("ok", None), ("timeout", None))), 2)  # k0 committing, k1 aborting
    assert t.abandon(3) == []


def test_a_shard_map_changed_between_begin_and_write_confirms_alone() -> None:
    """The router's shard map changed (a redeploy) after a begin was answered: its writes find
    no confirm count under the new map and are written to be confirmed alone (1), not a
    KeyError out of the save (review, 2026-12-05)."""
    shards = {"now": shard_of}
    t = SaveTable(save_plan(2, 1), lambda raw: shards["now"](raw), 4, 1000, BATCHES)
    sends = begun(t)
    for i, send in enumerate(sends):
        if i == len(sends) - 1:
            shards["now"] = lambda raw: 7  # the map moved before the last answer
        reply = m.PutBeginReply(epoch=1, results=[placed(s.key, ticket(s.key, 10 + i)) for s in send.specs])
        effects = t.step(BeginAnswered(send.request, reply, "t"), 1)
    (write,) = effects
    assert isinstance(write, WriteReplicas) and all(w.together >= 1 for w in write.writes)
    t.check_invariants()

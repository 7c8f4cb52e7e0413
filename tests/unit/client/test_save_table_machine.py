"""The client's save table against a simple model, over random answers and orders (Hypothesis).

One save per example, of 1..4 chunks of 1..2 members, over 2 directory shards, with small batch
bounds (so a phase sends several requests). Random orders of: the preparation (digests, or no
shard map), each `put_begin` answered in any order (a cause for the whole request, or per key
placed with 1..2 tickets, exists, not_admitted, another refusal, no result, a result twice; other
saves' results mixed in, as in a shared request), the writes (each ok, with or without a receipt,
or a cause), each commit and abort answered in any order (a cause, or per key a commit status,
no result, a result twice), a second answer to a request already answered, time passing, and
the save abandoned (cancelled) in any phase before it is done, its begins still out answered after.

The model keeps what each key was answered and derives every effect the table must return: the
begin batches (each planned key once, one shard, at most the bound, deadline = now + timeout),
the writes (every ticket of every placed key before the first not-admitted chunk, once, with its
request's trace id and confirm count), the commits (exactly the keys with a written replica, with
their writes' receipts) and aborts (every other placed key), and the result. Every step's
effects must equal the model's exactly. Every example ends by answering everything: then every
placed key was committed or aborted exactly once, nothing without a written replica was
committed, no ticket was written twice, and the result is the model's; an abandoned one has no
result, and every key its begins placed (answered before `abandon` or after) was committed or
aborted exactly once too: aborted at `abandon` unless a commit or abort already carried it, or on
its begin's late answer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

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
    ShardMapUnknown,
    WritesDone,
)
from kvfabric.client.saves import COMMITTED, SavePlan
from kvfabric.format.ids import ChainHash, ObjectKey
from kvfabric.proto import directory as m

T = TypeVar("T")

TIMEOUT_MS = 500
AT_ONCE = 2  # writes the shell runs at once per segment
BATCHES = SaveBatches(begin=2, commit=2, abort=3)
SEGMENTS = ("seg-a", "seg-b")
FOREIGN = (ObjectKey(b"other\x00"), ObjectKey(b"other\x01"))
COMMIT_STATUSES = (
    "published",
    "degraded",
    "waiting_group",
    "exists",
    "missing",
    "not_found",
)  # a key of another save sharing a request


def shard_of(raw: bytes) -> int:
    return raw[-1] % 2


def save_plan(chunks: int, members: int) -> SavePlan:
    keys = [ObjectKey(bytes([c, j, c * members + j])) for c in range(chunks) for j in range(members)]
    data = {k: memoryview(bytes(1 + k[0] * 3 + k[1])) for k in keys}
    return SavePlan(tuple(keys), data, {k: k[0] for k in keys}, {k: ChainHash(b"") for k in keys})


@dataclass
class Model:
    plan: SavePlan
    cause_of: dict[int, str] = field(default_factory=dict)  # failed chunk -> its first cause
    failed: set[int] = field(default_factory=set)  # chunks
    existing: set[int] = field(default_factory=set)
    existing_keys: set[ObjectKey] = field(default_factory=set)
    not_admitted: set[int] = field(default_factory=set)
    placed: dict[int, list[m.BeginResult]] = field(default_factory=dict)  # per begin request
    together: dict[int, Counter[str]] = field(default_factory=dict)  # placed tickets per segment
    traces: dict[int, str] = field(default_factory=dict)
    answered: set[ObjectKey] = field(default_factory=set)
    writes: list[Write] = field(default_factory=list)
    reachable: list[m.BeginResult] = field(default_factory=list)
    unreachable: list[ObjectKey] = field(default_factory=list)
    written: list[ObjectKey] = field(default_factory=list)
    bytes_written: int = 0
    committed: set[ObjectKey] = field(default_factory=set)
    commit_answered: set[ObjectKey] = field(default_factory=set)

    def fail(self, key: ObjectKey, cause: str) -> None:
        self.fail_chunk(self.plan.chunk_of[key], cause)

    def fail_chunk(self, chunk: int, cause: str) -> None:
        """Causes count failed chunks, each once, by the first cause it failed by."""
        self.failed.add(chunk)
        self.cause_of.setdefault(chunk, cause)

    def result(self) -> SaveResult:
        chunks = set(self.plan.chunk_of.values())
        # a chunk counts only when each of its members was committed or existed
        whole = {
            c
            for c in chunks
            if all(k in self.committed or k in self.existing_keys for k in self.plan.keys if k[0] == c)
        }
        saved = {self.plan.chunk_of[k] for k in self.committed} - self.failed - (chunks - whole)
        existing = self.existing - self.failed - saved - (chunks - whole)
        causes = Counter(self.cause_of[c] for c in self.failed)
        unanswered = len(chunks - saved - existing - self.failed)
        if unanswered:
            causes["unanswered"] += unanswered
        return SaveResult(
            chunks_saved=len(saved),
            chunks_existing=len(existing),
            chunks_failed=len(chunks - saved - existing),
            bytes_written=self.bytes_written,
            causes=dict(causes),
        )


class SaveTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.tickets = 0
        self.begins: dict[int, SendBegin] = {}
        self.write: WriteReplicas | None = None
        self.ends: dict[int, SendCommit | SendAbort] = {}
        self.answered: list[int] = []  # request numbers answered (for second answers)
        self.sent_commits: list[ObjectKey] = []
        self.sent_aborts: list[ObjectKey] = []
        self.missing_aborted: set[ObjectKey] = set()  # keys aborted after a commit answered `missing`
        self.ticket_writes: list[int] = []
        self.finished: Finished | None = None

    # ---- helpers -------------------------------------------------------------------------------

    def step(self, event: object, expected: list[Effect] | None) -> list[Effect]:
        effects: list[Effect] = self.table.step(event, self.now)  # type: ignore[arg-type]
        if expected is not None:
            assert effects == expected, (effects, expected)
        return self.record(effects)

    def record(self, effects: list[Effect]) -> list[Effect]:
        for e in effects:
            if isinstance(e, SendBegin):
                self.begins[e.request] = e
            elif isinstance(e, WriteReplicas):
                assert self.write is None
                self.write = e
                self.ticket_writes += [w.ticket.ticket_id for w in e.writes]
            elif isinstance(e, SendCommit):
                self.ends[e.request] = e
                self.sent_commits += [k for k, _ in e.items]
            elif isinstance(e, SendAbort):
                self.ends[e.request] = e
                self.sent_aborts += list(e.keys)
            elif isinstance(e, Finished):
                assert self.finished is None
                self.finished = e
        return effects

    def ticket(self, key: ObjectKey, segment: str) -> m.WriteTicket:
        self.tickets += 1
        return m.WriteTicket(
            ticket_id=self.tickets,
            key=key,
            segment_id=segment,
            incarnation=1,
            size_bytes=len(self.plan.data.get(key, b"")),
            checksum=b"",
            writer_id="w",
            deadline_ms=0,
            epoch=1,
            data_addr=segment,
        )

    def expected_aborts(self, keys: list[ObjectKey]) -> list[Effect]:
        """Aborts of `keys` per shard (first seen first) batch, numbered from the next request."""
        request = self.table._next_request
        effects: list[Effect] = []
        for shard in dict.fromkeys(shard_of(k) for k in keys):
            mine = [k for k in keys if shard_of(k) == shard]
            for i in range(0, len(mine), BATCHES.abort):
                effects.append(
                    SendAbort(request, shard, tuple(mine[i : i + BATCHES.abort]), self.now + TIMEOUT_MS)
                )
                request += 1
        return effects

    def expected_ends(self) -> list[Effect]:
        """After the writes: aborts, then commits, per shard batch; or Finished."""
        deadline = self.now + TIMEOUT_MS
        request = self.table._next_request
        effects: list[Effect] = []
        aborts = [r.key for r in self.model.reachable if r.key not in self.model.written]
        aborts += self.model.unreachable
        for shard in dict.fromkeys(shard_of(k) for k in aborts):
            mine = [k for k in aborts if shard_of(k) == shard]
            for i in range(0, len(mine), BATCHES.abort):
                effects.append(SendAbort(request, shard, tuple(mine[i : i + BATCHES.abort]), deadline))
                request += 1
        receipts: dict[ObjectKey, list[m.WriteReceipt]] = {}
        for w, (_, receipt) in zip(self.model.writes, self.outcomes, strict=True):
            if receipt is not None:
                receipts.setdefault(w.key, []).append(receipt)
        commits = [(k, tuple(receipts.get(k, []))) for k in self.model.written]
        for shard in dict.fromkeys(shard_of(k) for k, _ in commits):
            items = [c for c in commits if shard_of(c[0]) == shard]
            for i in range(0, len(items), BATCHES.commit):
                effects.append(SendCommit(request, shard, tuple(items[i : i + BATCHES.commit]), deadline))
                request += 1
        return effects or [Finished(self.model.result())]

    def after_writes(self, outcomes: list[tuple[str, m.WriteReceipt | None]]) -> None:
        """The model's view of the writes' outcomes (one per model write)."""
        self.outcomes = outcomes
        for r in self.model.reachable:
            mine = [o for w, (o, _) in zip(self.model.writes, outcomes, strict=True) if w.key == r.key]
            oks = sum(o == "ok" for o in mine)
            if oks:
                self.model.written.append(r.key)
                self.model.bytes_written += len(self.plan.data[r.key]) * oks
            else:
                self.model.fail_chunk(self.plan.chunk_of[r.key], mine[0])

    def expected_writes(self) -> list[Effect]:
        """After the last begin answer: the writes (or, with none, the ends)."""
        model = self.model
        placed = [r for request in sorted(model.placed) for r in model.placed[request]]
        first = min(model.not_admitted, default=None)
        for r in placed:
            if first is not None and self.plan.chunk_of[r.key] >= first:
                model.unreachable.append(r.key)
                model.fail(r.key, "not_admitted")
            else:
                model.reachable.append(r)
        for request in sorted(model.placed):
            for r in model.placed[request]:
                if r.key in model.unreachable:
                    continue
                for t in r.tickets:
                    together = min(model.together[request][t.segment_id], AT_ONCE)
                    model.writes.append(Write(r.key, t, model.traces[request], together))
        if model.writes:
            return [WriteReplicas(tuple(model.writes))]
        self.after_writes([])
        return self.expected_ends()

    # ---- rules ---------------------------------------------------------------------------------

    @initialize(chunks=st.integers(1, 4), members=st.integers(1, 2))
    def open(self, chunks: int, members: int) -> None:
        self.plan = save_plan(chunks, members)
        self.model = Model(self.plan)
        self.table = SaveTable(self.plan, shard_of, AT_ONCE, TIMEOUT_MS, BATCHES)
        self.step(Open(), [PrepareBegins()])

    def tick(self, ms: int) -> None:
        self.now += ms

    @precondition(lambda self: self.table.state == "preparing")
    @rule(unknown=st.integers(0, 9), ms=st.integers(0, 5))
    def prepare(self, unknown: int, ms: int) -> None:
        self.tick(ms)
        if not unknown:
            chunks = len(self.plan.chunks)
            result = SaveResult(chunks_failed=chunks, causes={"directory_unavailable": chunks})
            self.step(ShardMapUnknown(), [Finished(result, begun=False)])
            return
        digests = tuple(bytes([i]) for i in range(len(self.plan.keys)))
        effects = self.step(Prepared(digests), None)
        sent = [s.key for e in effects if isinstance(e, SendBegin) for s in e.specs]
        assert sorted(sent) == sorted(self.plan.keys) and len(sent) == len(set(sent))
        for e in effects:
            assert isinstance(e, SendBegin) and 1 <= len(e.specs) <= BATCHES.begin
            assert {shard_of(s.key) for s in e.specs} == {e.shard}
            assert e.deadline_ms == self.now + TIMEOUT_MS
            assert all(s.checksum == digests[self.plan.keys.index(s.key)] for s in e.specs)

    @precondition(lambda self: bool(self.begins))
    @rule(data=st.data(), ms=st.integers(0, 5))
    def answer_begin(self, data: st.DataObject, ms: int) -> None:
        self.tick(ms)
        request = choose(data, sorted(self.begins))
        sent = self.begins.pop(request)
        self.answered.append(request)
        model = self.model
        trace = f"trace-{request}"
        cause = choose(data, [None] * 5 + ["directory_timeout", "busy", "unavailable"])
        if cause is not None:
            for spec in sent.specs:
                model.fail(spec.key, cause)
            reply: object = cause
        else:
            results: list[m.BeginResult] = []
            for spec in sent.specs:
                kind = choose(
                    data, ["placed", "placed", "exists", "not_admitted", "no_capacity", "omit", "twice"]
                )
                if kind == "omit":
                    continue
                status = "placed" if kind == "twice" else kind
                tickets = [self.ticket(spec.key, s) for s in choose(data, [SEGMENTS, SEGMENTS[:1]])]
                results.append(
                    m.BeginResult(key=spec.key, status=status, tickets=tickets if status == "placed" else [])  # type: ignore[arg-type]
                )
                if kind == "twice":  # a second result for the key: the first is used
                    results.append(m.BeginResult(key=spec.key, status="exists"))
            if choose(data, [False, True]):  # another save's object in the shared request
                results.append(
                    m.BeginResult(
                        key=FOREIGN[sent.shard],
                        status="placed",
                        tickets=[self.ticket(FOREIGN[sent.shard], "seg-a")],
                    )
                )
            reply = m.PutBeginReply(epoch=1, results=results)
            placed: list[m.BeginResult] = []
            for r in results:
                if r.key in FOREIGN or r.key in model.answered:
                    continue
                model.answered.add(r.key)
                if r.status == "placed":
                    placed.append(r)
                elif r.status == "exists":
                    model.existing.add(self.plan.chunk_of[r.key])
                    model.existing_keys.add(r.key)
                else:
                    if r.status == "not_admitted":
                        model.not_admitted.add(self.plan.chunk_of[r.key])
                    model.fail(r.key, r.status)
            model.placed[request] = placed
            model.traces[request] = trace
            model.together[request] = Counter(
                t.segment_id for r in results if r.status == "placed" for t in r.tickets
            )
        if self.table.state == "abandoned":  # what it placed is aborted at once
            expected = self.expected_aborts([r.key for r in model.placed.get(request, [])])
        else:
            expected = [] if self.begins else self.expected_writes()
        self.step(BeginAnswered(request, reply, trace), expected)

    @precondition(lambda self: self.write is not None)
    @rule(data=st.data(), ms=st.integers(0, 5))
    def answer_writes(self, data: st.DataObject, ms: int) -> None:
        self.tick(ms)
        assert self.write is not None
        outcomes: list[tuple[str, m.WriteReceipt | None]] = []
        for w in self.write.writes:
            kind = choose(data, ["ok", "receipt", "ok", "segment_down", "timeout"])
            if kind == "receipt":
                outcomes.append(("ok", m.WriteReceipt(w.ticket.ticket_id, 1, 1, b"mac")))
            else:
                outcomes.append((kind, None))
        self.write = None
        self.after_writes(outcomes)
        self.step(WritesDone(tuple(outcomes)), self.expected_ends())

    @precondition(lambda self: bool(self.ends))
    @rule(data=st.data(), ms=st.integers(0, 5))
    def answer_end(self, data: st.DataObject, ms: int) -> None:
        self.tick(ms)
        request = choose(data, sorted(self.ends))
        sent = self.ends.pop(request)
        self.answered.append(request)
        model = self.model
        reply: object
        cause = choose(data, [None] * 5 + ["directory_timeout", "busy"])
        if cause is not None:
            reply = cause
            if isinstance(sent, SendCommit):
                for key, _ in sent.items:
                    model.fail(key, cause)
        elif isinstance(sent, SendAbort):
            reply = m.PutAbortReply(epoch=1, aborted=len(sent.keys))
        else:
            results: list[m.CommitResult] = []
            missing: list[ObjectKey] = []  # first answered `missing`: aborted by the table
            for key, _ in sent.items:
                status = choose(data, [*COMMIT_STATUSES, "omit", "twice"])
                if status == "omit":
                    continue
                first = "published" if status == "twice" else status
                results.append(m.CommitResult(key=key, status=first))  # type: ignore[arg-type]
                if status == "twice":
                    results.append(m.CommitResult(key=key, status="not_found"))
                if key not in model.commit_answered:
                    model.commit_answered.add(key)
                    if first in COMMITTED:
                        model.committed.add(key)
                    else:
                        model.fail(key, first)
                    if first == "missing":
                        missing.append(key)
            results.append(m.CommitResult(key=FOREIGN[sent.shard], status="published"))  # another save's
            reply = m.PutCommitReply(epoch=1, results=results)
        expected: list[Effect] = [] if self.ends else [Finished(model.result())]
        if self.table.state != "abandoned" and isinstance(sent, SendCommit) and cause is None and missing:
            # its keys still placed there: aborted, not awaited (review, stop 68)
            expected = self.expected_aborts(missing) + expected
        if self.table.state == "abandoned":  # not awaited: ignored (counted)
            expected = []
        effects = self.step(EndAnswered(request, reply), expected)
        for e in effects:  # the aborts of keys committed `missing`: never answered
            if isinstance(e, SendAbort) and not self.table.awaits(e.request):
                del self.ends[e.request]
                self.missing_aborted.update(e.keys)

    @precondition(lambda self: self.table.state in ("preparing", "beginning", "writing", "ending"))
    @rule(pick=st.integers(0, 7), ms=st.integers(0, 5))
    def abandon(self, pick: int, ms: int) -> None:
        """The save cancelled (1 in 8 picks): every key placed and not yet carried by a commit or
        abort is aborted; the writes' answer never comes; begins still out may still answer."""
        if pick != 5:
            return
        self.tick(ms)
        ended = set(self.sent_commits + self.sent_aborts)
        placed = [r.key for request in sorted(self.model.placed) for r in self.model.placed[request]]
        expected = self.expected_aborts([k for k in dict.fromkeys(placed) if k not in ended])
        aborts: list[Effect] = list(self.table.abandon(self.now))
        assert aborts == expected, (aborts, expected)
        self.record(aborts)
        self.write = None
        assert self.table.state == "abandoned" and self.table.result is None

    @rule(ms=st.sampled_from([0, 1, 1000]))
    def time_passes(self, ms: int) -> None:
        """Time passing alone changes nothing (deadlines are the shell's to enforce)."""
        self.tick(ms)

    @precondition(lambda self: bool(self.answered))
    @rule(pick=st.integers(0, 100))
    def second_answer(self, pick: int) -> None:
        """A request answered again (or a stale one): ignored, counted."""
        request = self.answered[pick % len(self.answered)]
        before = self.table.counters.get("answers_unknown_total", 0)
        self.step(EndAnswered(request, "late"), [])
        self.step(BeginAnswered(request, "late", "t"), [])
        assert self.table.counters["answers_unknown_total"] == before + 2

    # ---- checks --------------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.table.check_invariants()
        commits, aborts = self.sent_commits, self.sent_aborts
        assert len(commits) == len(set(commits)) and len(aborts) == len(set(aborts))
        assert set(commits).isdisjoint(set(aborts) - self.missing_aborted)
        assert self.missing_aborted <= set(commits)  # (aborted after a commit answered `missing`)
        assert set(commits) <= set(self.model.written)  # never without a written replica
        assert len(self.ticket_writes) == len(set(self.ticket_writes))
        assert not set(FOREIGN) & set(commits + aborts)

    def teardown(self) -> None:
        if not hasattr(self, "table"):
            return
        if self.table.state == "preparing":
            self.prepare(1, 0)
        for rule_, pending in (
            (self.answer_begin, "begins"),
            (self.answer_writes, "write"),
            (self.answer_end, "ends"),
        ):
            while getattr(self, pending):
                rule_(_FaultFree(), 0)
        self.consistent()
        if self.table.state == "abandoned":
            assert self.finished is None and self.table.result is None
            ended = sorted(self.sent_commits + [k for k in self.sent_aborts if k not in self.missing_aborted])
            placed = [r.key for rs in self.model.placed.values() for r in rs]
            assert ended == sorted(placed)  # no reservation left to the write TTL
            return
        assert self.finished is not None and self.table.state == "done"
        assert self.table.result == self.finished.result
        if self.finished.begun:
            assert self.finished.result == self.model.result()
            ended = sorted(self.sent_commits + [k for k in self.sent_aborts if k not in self.missing_aborted])
            placed = [r.key for rs in self.model.placed.values() for r in rs]
            assert ended == sorted(placed)  # every reservation ended exactly once
            assert self.model.committed <= set(self.sent_commits)


class _FaultFree:
    """A `data` whose every choice is the first: placed, written, published (the fault-free end)."""

    def draw(self, strategy: object) -> int:
        return 0


def choose(data: st.DataObject | _FaultFree, options: list[T]) -> T:
    """One of `options`, drawn (the first when fault-free)."""
    return options[data.draw(st.integers(0, len(options) - 1))]


TestSaveTableMachine = SaveTableMachine.TestCase
TestSaveTableMachine.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

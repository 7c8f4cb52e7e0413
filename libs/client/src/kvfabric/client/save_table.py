"""The save table of the engine-side client: one two-phase save's decisions, as a state machine.

Synchronous and I/O-free: no clock, no asyncio, no sockets (the load side's counterpart is
`kvfabric.core.client_loads.LoadTable`). The shell (`kvfabric.client.aio_saves`) feeds events in
(`open`, `prepared`, `shard_map_unknown`, `begin_answered`, `writes_done`, `end_answered`, or all
through one entry: `step(event, now_ms)`, `kvfabric.core.step`, the events in
`kvfabric.client.save_table_events`), performs the returned effects (those of one step may run
concurrently) and feeds each one's answer back, until `Finished`. Time is passed in (`now_ms`,
the shell's monotonic clock, `kvfabric.format.clock.monotonic_ms`). What each phase means on the
wire is `kvfabric.client.saves` (whose `SaveTally` this table counts with).

## States of the save
    OPEN --open, no objects--> DONE (Finished: nothing to save)
    OPEN --open--> PREPARING (PrepareBegins: learn the shard map; the checksums to name, if any)
    PREPARING --shard_map_unknown--> DONE (every chunk failed: directory_unavailable)
    PREPARING --prepared(digests)--> BEGINNING (one SendBegin per shard batch)
    BEGINNING --begin_answered, the last--> WRITING (WriteReplicas), or ENDING/DONE with nothing
                                           to write
    WRITING --writes_done--> ENDING (SendAbort, SendCommit per shard batch), or DONE with nothing
                             to end
    ENDING --end_answered, a commit answered `missing` for keys--> ENDING (SendAbort of them, not
             awaited: the shell sends them in the background)
    ENDING --end_answered, the last--> DONE (Finished(result), after any such SendAbort)
    any but DONE --abandon (the save cancelled)--> ABANDONED (SendAbort per shard batch of every
                 key a begin answer placed and no commit or abort carried; no result)
    ABANDONED --begin_answered (a begin out at `abandon` whose request went)--> ABANDONED
                 (SendAbort per shard batch of the keys it placed)
In ABANDONED nothing awaits the aborts' answers, commits and aborts still out are not awaited
either (the shell lets them go: `abandon` counts their keys ended), and only begin answers are
used; a begin the shell withdrew unsent is never answered (it placed nothing).
A request is named by its number (`request`); an answer naming no outstanding request of the
phase (a second answer, or a stale one) is counted and ignored.

## States of an object (a key of the plan)
    planned --in a begin request--> begun --answer--> placed | exists | refused (a status, or the
    whole request's cause; `not_admitted` included)
    placed --at or after the first not-admitted chunk--> unreachable: aborted, no byte written
    placed --writes--> written (>= 1 replica ok): committed with its receipts (a partial object
           is committed too: the directory keeps it degraded and repair tops it up)
    placed --writes--> write_failed (no replica ok): aborted
    committing --answer--> committed (`saves.COMMITTED`) | commit_failed
    committing --answer `missing` (no replica confirmed: still placed, under this writer)-->
           commit_failed, aborted (it held the key `in_flight` for every writer until the TTL)
    aborting --answer (whatever it is)--> aborted (a lost abort expires at the directory after
           the put's write TTL: nothing to retry)

## Decisions
- Begin: every planned key goes in exactly one `put_begin`, split per shard (`shard_of`) in
  batches of at most `begin_batch_max` (`shard_batches`). A request without a usable reply (a cause:
  `directory_timeout` when its deadline passed, `busy` after the shell's bounded retries,
  `unavailable` ...) fails its keys' chunks with that cause; what the directory may have placed
  for them expires there after the write TTL.
- Write: each ticket of each reachable placed object is written exactly once (never retried:
  the engine recomputes what a save could not publish); a write names the begin request's trace
  id and how many writes of that request its segment may confirm together (`confirm_counts`).
- End: an object with a written replica is committed (`with_receipts`), every other placed one
  aborted; commits and aborts go out together (different keys), per shard in batches.
- Deadlines: each request carries `deadline_ms` = the step's `now_ms` + `timeout_ms` (one per
  phase, as the shell's `save_timeout_ms`); the shell answers a request whose deadline passed
  with a cause. The shell bounds the write phase by the same timeout (each write cut at it,
  a write still queued then never sent: `timeout`).
- Retries: none here. The shell retries a `busy` request a bounded number of times within its
  deadline (`kvfabric.client.busy`); `SharedCalls` resends a `bad_request` save by save.

## Invariants (`check_invariants()`, after every step in tests)
1. Every planned key is sent in exactly one begin request; requests hold 1..batch_max items of
   one shard; a begin answer is used once per key (a key answered twice keeps the first).
2. Every placed key ends exactly once: in one commit request or in one abort request, never
   both (but a commit answered `missing`, then one abort), never twice; nothing without a
   written replica is committed; nothing unreachable is written; each ticket is written at most
   once.
3. A key counted committed was sent in a commit request (and answered committed).
4. DONE: no request outstanding; every chunk of the plan is exactly one of saved, existing or
   failed (`SaveTally.result`).
5. ABANDONED: no result; only begin requests outstanding; every key ended (in a commit or an
   abort request) was placed by a begin answer, and with no begin outstanding every placed key
   was ended exactly once (a cancelled save leaves no reservation to the write TTL).

Caller bugs raise `InvariantViolation`: an event out of its phase, time going backwards,
digests or write outcomes of the wrong count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias, TypeVar

from kvfabric.client import save_table_events
from kvfabric.client.hits import SaveResult
from kvfabric.client.save_table_events import SaveEvent
from kvfabric.client.saves import SavePlan, SaveTally, confirm_counts, object_specs, with_receipts
from kvfabric.core.step import not_before
from kvfabric.format.ids import ObjectKey
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m

__all__ = [
    "DIRECTORY_UNAVAILABLE",
    "Effect",
    "Finished",
    "PrepareBegins",
    "SaveBatches",
    "SaveTable",
    "SendAbort",
    "SendBegin",
    "SendCommit",
    "Write",
    "WriteReplicas",
    "shard_batches",
]

DIRECTORY_UNAVAILABLE: Final = "directory_unavailable"

State: TypeAlias = Literal["open", "preparing", "beginning", "writing", "ending", "done", "abandoned"]
Verb: TypeAlias = Literal["put_begin", "put_commit", "put_abort"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PrepareBegins:
    """Hash every object and learn the shard map; answer `prepared` or `shard_map_unknown`."""


@dataclass(frozen=True, slots=True)
class SendBegin:
    """Send `put_begin` for `specs` to `shard` by `deadline_ms`; answer `begin_answered`."""

    request: int
    shard: int
    specs: tuple[m.ObjectSpec, ...]
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class Write:
    """One replica write: `key`'s bytes to `ticket`, with the begin request's trace id and how
    many writes of that request its segment may confirm together."""

    key: ObjectKey
    ticket: m.WriteTicket
    trace_id: str
    together: int


@dataclass(frozen=True, slots=True)
class WriteReplicas:
    """Run every write; answer `writes_done` with one outcome per write, in this order."""

    writes: tuple[Write, ...]


@dataclass(frozen=True, slots=True)
class SendCommit:
    """Send `put_commit` for `items` (key, its writes' receipts) to `shard`; answer `end_answered`."""

    request: int
    shard: int
    items: tuple[tuple[ObjectKey, tuple[m.WriteReceipt, ...]], ...]
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class SendAbort:
    """Send `put_abort` for `keys` to `shard`; answer `end_answered` (what it says changes nothing)."""

    request: int
    shard: int
    keys: tuple[ObjectKey, ...]
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class Finished:
    """The save's outcome; the table is DONE. `begun`: it sent a begin (only such a save counts in
    the client's saved tokens/bytes: an empty one, or one without a shard map, does not; a save
    without a shard map counts its chunks in save failures, `directory_unavailable`: it counted
    nowhere, review, stop 68; every admitted save is in `save_seconds` and the in-flight bytes)."""

    result: SaveResult
    begun: bool = True


Effect: TypeAlias = PrepareBegins | SendBegin | WriteReplicas | SendCommit | SendAbort | Finished


def shard_batches(
    items: Sequence[T], shard_of: Callable[[T], int], batch_max: int
) -> Iterator[tuple[int, list[T]]]:
    """(shard, batch): the items split by shard (first-seen order, each shard's in the original
    order), in batches of at most `batch_max` (a request takes one shard)."""
    invariant(batch_max >= 1, "batch_max must be at least 1", batch_max=batch_max)
    by_shard: dict[int, list[T]] = {}
    for item in items:
        by_shard.setdefault(shard_of(item), []).append(item)
    for shard, mine in by_shard.items():
        for start in range(0, len(mine), batch_max):
            yield shard, mine[start : start + batch_max]


@dataclass(slots=True)
class _Request:
    verb: Verb
    shard: int
    keys: tuple[ObjectKey, ...]


@dataclass(slots=True)
class _Begun:
    """A begin request's usable answer: this save's placed results, the trace id, confirm counts."""

    placed: list[m.BeginResult]
    trace_id: str
    together: dict[tuple[str, int], int]


@dataclass(frozen=True, slots=True)
class SaveBatches:
    """The most items one request of each verb carries."""

    begin: int
    commit: int
    abort: int


@dataclass(slots=True)
class SaveTable:
    """One save's phases. See the module docstring."""

    plan: SavePlan
    shard_of: Callable[[bytes], int]  # the directory shard of a key (the router's, at the time)
    writes_at_once: int  # writes the shell runs at once per segment (`confirm_counts`)
    timeout_ms: int  # each phase's directory deadline, from the step that sends it
    batches: SaveBatches
    state: State = "open"
    counters: dict[str, int] = field(default_factory=dict)
    _tally: SaveTally = field(init=False)
    _step_ms: int = 0
    _next_request: int = 1
    _outstanding: dict[int, _Request] = field(default_factory=dict)
    _sent: dict[Verb, list[ObjectKey]] = field(default_factory=dict)  # keys per verb, every request
    _begun: dict[int, _Begun] = field(default_factory=dict)  # answered begin requests
    _answered: set[ObjectKey] = field(default_factory=set)  # keys whose begin result was used
    _placed: list[m.BeginResult] = field(default_factory=list)  # reachable: to write
    _unreachable: list[ObjectKey] = field(default_factory=list)
    _writes: tuple[Write, ...] = ()
    _written: list[ObjectKey] = field(default_factory=list)  # >= 1 replica ok: to commit
    _failed_writes: list[ObjectKey] = field(default_factory=list)  # no replica ok: to abort
    _commit_answered: set[ObjectKey] = field(default_factory=set)
    _missing: list[ObjectKey] = field(default_factory=list)  # committed `missing`: then aborted
    _result: SaveResult | None = None

    def __post_init__(self) -> None:
        invariant(self.writes_at_once >= 1, "writes_at_once must be at least 1")
        invariant(self.timeout_ms >= 0, "negative timeout", timeout_ms=self.timeout_ms)
        self._tally = SaveTally(self.plan)

    def step(self, event: SaveEvent, now_ms: int) -> list[Effect]:
        """The one entry (`kvfabric.core.step`): `event` at `now_ms` as the method of the same
        meaning. Time going backwards is refused first."""
        self._step_ms = not_before(self._step_ms, now_ms)
        return save_table_events.dispatch(self, event, now_ms)

    @property
    def result(self) -> SaveResult | None:
        """The outcome once DONE."""
        return self._result

    # ---- events ------------------------------------------------------------------------------

    def open(self, now_ms: int) -> list[Effect]:
        """The save starts: with no objects it is done at once; else route them (PrepareBegins)."""
        self._phase("open", "open")
        if not self.plan.keys:
            return self._finish(SaveResult(), begun=False)
        self.state = "preparing"
        return [PrepareBegins()]

    def shard_map_unknown(self) -> list[Effect]:
        """No shard map: no request can be routed, every chunk fails (`directory_unavailable`)."""
        self._phase("preparing", "shard_map_unknown")
        chunks = len(self.plan.chunks)
        return self._finish(
            SaveResult(chunks_failed=chunks, causes={DIRECTORY_UNAVAILABLE: chunks}), begun=False
        )

    def prepared(self, digests: Sequence[bytes], now_ms: int) -> list[Effect]:
        """The checksums the objects name (in `plan.keys` order; empty: their segments'): begin
        every object, per shard batch."""
        self._phase("preparing", "prepared")
        invariant(len(digests) == len(self.plan.keys), "one digest per object", digests=len(digests))
        self.state = "beginning"
        specs = object_specs(self.plan, digests)
        effects: list[Effect] = []
        for shard, batch in shard_batches(specs, lambda s: self.shard_of(s.key), self.batches.begin):
            request = self._send("put_begin", shard, [s.key for s in batch])
            effects.append(SendBegin(request, shard, tuple(batch), now_ms + self.timeout_ms))
        return effects

    def begin_answered(self, request: int, reply: object, trace_id: str, now_ms: int) -> list[Effect]:
        """A begin request's reply (or cause). After the last one: the writes (or the end).
        ABANDONED: aborts of what it placed for this save."""
        sent = self._answer(request, "put_begin")
        if sent is None:
            return []
        if self.state == "abandoned":
            return self._abort_late(request, sent, reply, trace_id, now_ms)
        if not isinstance(reply, m.PutBeginReply):
            self._tally.refused(list(sent.keys), str(reply))
        else:
            mine = set(sent.keys) - self._answered
            results = [r for r in reply.results if r.key in mine and not self._first_answer(r.key)]
            placed = self._tally.begun(results)
            # The reply is the whole request's (other saves may have shared it): every placed
            # object in it is a write its segments see from this request.
            together = confirm_counts(
                (r for r in reply.results if r.status == "placed"), self.shard_of, self.writes_at_once
            )
            self._begun[request] = _Begun(placed, trace_id, together)
        if any(r.verb == "put_begin" for r in self._outstanding.values()):
            return []
        return self._write(now_ms)

    def writes_done(self, outcomes: Sequence[tuple[str, m.WriteReceipt | None]], now_ms: int) -> list[Effect]:
        """Every write's (outcome, receipt): commit what has a replica, abort the rest."""
        self._phase("writing", "writes_done")
        return self._end(outcomes, now_ms)

    def end_answered(self, request: int, reply: object, now_ms: int = 0) -> list[Effect]:
        """An abort's or a commit's reply (or cause). A key committed `missing` (no replica of
        it confirmed: its segment lost, its receipt refused) is still placed there, under this
        writer: aborted (it blocked the key for every writer, this one's next save included, and
        held its reservation, until the write TTL; review, stop 68). After the last: `Finished`."""
        sent = self._answer(request, "put_commit", "put_abort")
        if sent is None:
            return []
        effects: list[Effect] = []
        if sent.verb == "put_commit":
            if not isinstance(reply, m.PutCommitReply):
                self._tally.refused(list(sent.keys), str(reply))
            else:
                mine = set(sent.keys) - self._commit_answered
                results = []
                for r in reply.results:
                    if r.key in mine:
                        mine.discard(r.key)  # a key answered twice keeps the first
                        self._commit_answered.add(r.key)
                        results.append(r)
                self._tally.commits(results)
                missing = [r.key for r in results if r.status == "missing"]
                self._missing += missing
                # not awaited: their answers change nothing, and waiting for them took a save
                # past its three phases' bounds (review of stop 68's fix); the shell sends them
                # in the background (`SendAbort` beside `Finished` or before it, not outstanding)
                effects += self._abort_unawaited(missing, now_ms)
        if self._outstanding:
            return effects
        return effects + self._finish()

    # ---- plumbing ----------------------------------------------------------------------------

    def awaits(self, request: int) -> bool:
        """Whether request `request` is outstanding (its answer is to be fed back)."""
        return request in self._outstanding

    def _phase(self, state: State, event: str) -> None:
        invariant(self.state == state, "event out of its phase", event=event, state=self.state)

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def _send(self, verb: Verb, shard: int, keys: list[ObjectKey]) -> int:
        request = self._next_request
        self._next_request += 1
        self._outstanding[request] = _Request(verb, shard, tuple(keys))
        self._sent.setdefault(verb, []).extend(keys)
        return request

    def _answer(self, request: int, *verbs: Verb) -> _Request | None:
        """The outstanding request `request` of one of `verbs`, now answered; None (counted) for
        an answer naming none (a second answer, or one of another phase)."""
        sent = self._outstanding.get(request)
        if sent is None or sent.verb not in verbs:
            self._count("answers_unknown_total")
            return None
        del self._outstanding[request]
        return sent

    def _first_answer(self, key: ObjectKey) -> bool:
        """False the first time `key`'s begin result is used, True (counted) after."""
        if key in self._answered:
            self._count("begin_results_repeated_total")
            return True
        self._answered.add(key)
        return False

    def _write(self, now_ms: int) -> list[Effect]:
        """Every begin answered: write what is placed and reachable (in request order)."""
        placed: list[m.BeginResult] = []
        writes: list[tuple[m.BeginResult, Write]] = []
        for request in sorted(self._begun):
            begun = self._begun[request]
            placed += begun.placed
            # `together` was counted under the shard map of the begin's answer: one that changed
            # since (a redeploy) finds no count, and the write is confirmed alone (1) instead of
            # the save failing with a KeyError (review, 2026-12-05)
            counts = begun.together
            writes += [
                (r, Write(r.key, t, begun.trace_id, counts.get((t.segment_id, self.shard_of(r.key)), 1)))
                for r in begun.placed
                for t in r.tickets
            ]
        self._placed, self._unreachable = self._tally.unreachable(placed)
        if self._unreachable:  # drop the writes of what is not reachable (most saves: none)
            kept = {id(r) for r in self._placed}
            writes = [(r, w) for r, w in writes if id(r) in kept]
        self._writes = tuple(w for _, w in writes)
        self.state = "writing"
        if not self._writes:
            return self._end((), now_ms)
        return [WriteReplicas(self._writes)]

    def _end(self, outcomes: Sequence[tuple[str, m.WriteReceipt | None]], now_ms: int) -> list[Effect]:
        invariant(len(outcomes) == len(self._writes), "one outcome per write", outcomes=len(outcomes))
        self._written, self._failed_writes = self._tally.wrote(self._placed, [o for o, _ in outcomes])
        commits = with_receipts(
            self._written, ((w.key, r) for w, (_, r) in zip(self._writes, outcomes, strict=True))
        )
        aborts = self._failed_writes + self._unreachable
        self.state = "ending"
        deadline_ms = now_ms + self.timeout_ms
        effects: list[Effect] = []
        for shard, keys in shard_batches(aborts, self.shard_of, self.batches.abort):
            effects.append(SendAbort(self._send("put_abort", shard, keys), shard, tuple(keys), deadline_ms))
        for shard, items in shard_batches(commits, lambda i: self.shard_of(i[0]), self.batches.commit):
            request = self._send("put_commit", shard, [k for k, _ in items])
            effects.append(SendCommit(request, shard, tuple((k, tuple(rs)) for k, rs in items), deadline_ms))
        return effects or self._finish()

    def abandon(self, now_ms: int) -> list[SendAbort]:
        """The save was cancelled (its caller gone, the client closing) before DONE: aborts of
        every key a begin answer placed for it and no commit or abort request carried yet, for
        the shell to send without waiting (they would otherwise hold their reservations, counted
        against the tenant's pending bounds, until the write TTL). A commit or abort request
        already made counts its keys ended: the shell sends it even so. The table is ABANDONED
        after, with no result: a begin still out stays outstanding, its answer (if its request
        went) giving the aborts of what it placed; answers to commits and aborts are ignored
        (counted)."""
        invariant(self.state not in ("done", "abandoned"), "abandon after the save ended", state=self.state)
        ended = set(self._sent.get("put_commit", ())) | set(self._sent.get("put_abort", ()))
        keys = [r.key for request in sorted(self._begun) for r in self._begun[request].placed]
        keys = [k for k in dict.fromkeys(keys) if k not in ended]
        self.state = "abandoned"
        self._outstanding = {n: r for n, r in self._outstanding.items() if r.verb == "put_begin"}
        return self._abort_unawaited(keys, now_ms)

    def _abort_late(
        self, request: int, sent: _Request, reply: object, trace_id: str, now_ms: int
    ) -> list[Effect]:
        """ABANDONED: a begin's answer that came after `abandon`: aborts of what it placed."""
        placed: list[m.BeginResult] = []
        if isinstance(reply, m.PutBeginReply):
            mine = set(sent.keys) - self._answered
            results = [r for r in reply.results if r.key in mine and not self._first_answer(r.key)]
            placed = [r for r in results if r.status == "placed"]
        self._begun[request] = _Begun(placed, trace_id, {})
        return list(self._abort_unawaited([r.key for r in placed], now_ms))

    def _abort_unawaited(self, keys: list[ObjectKey], now_ms: int) -> list[SendAbort]:
        """Aborts of `keys` per shard batch, sent and never awaited (not outstanding): ABANDONED,
        or keys committed `missing`."""
        deadline_ms = now_ms + self.timeout_ms
        aborts = []
        for shard, batch in shard_batches(keys, self.shard_of, self.batches.abort):
            request = self._send("put_abort", shard, batch)
            del self._outstanding[request]
            aborts.append(SendAbort(request, shard, tuple(batch), deadline_ms))
        return aborts

    def _finish(self, result: SaveResult | None = None, *, begun: bool = True) -> list[Effect]:
        self.state = "done"
        self._result = result if result is not None else self._tally.result()
        return [Finished(self._result, begun)]

    # ---- invariants --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        keys = set(self.plan.keys)
        begun = self._sent.get("put_begin", [])
        if self.state in ("beginning", "writing", "ending") or (
            self.state in ("done", "abandoned") and begun
        ):
            invariant(sorted(begun) == sorted(keys), "a key not begun exactly once")
        invariant(self._answered <= keys, "a begin result for a key not of this save")
        placed = [r.key for r in self._placed]
        invariant(len(placed) == len(set(placed)), "a key placed twice")
        invariant(set(placed).isdisjoint(self._unreachable), "an unreachable key is written")
        written = [w.key for w in self._writes]
        invariant(set(written) <= set(placed), "a write for a key not placed and reachable")
        tickets = [(w.ticket.segment_id, w.ticket.ticket_id) for w in self._writes]
        invariant(len(tickets) == len(set(tickets)), "a ticket written twice")
        commits = self._sent.get("put_commit", [])
        aborts = self._sent.get("put_abort", [])
        invariant(len(commits) == len(set(commits)), "a key committed twice")
        invariant(len(aborts) == len(set(aborts)), "a key aborted twice")
        invariant(set(self._missing) <= set(commits), "an abort after a commit not sent")
        first_end = [k for k in aborts if k not in self._missing]  # (those: aborted after a commit)
        invariant(set(commits).isdisjoint(first_end), "a key both committed and aborted")
        invariant(set(commits) == set(self._written), "a commit for a key without a written replica")
        if self.state in ("ending", "done") and placed + self._unreachable:
            ended = sorted(commits + first_end)
            invariant(ended == sorted(placed + self._unreachable), "a placed key not ended exactly once")
        invariant(self._tally.committed <= set(commits), "committed without a commit request")
        for request, sent in self._outstanding.items():
            invariant(request < self._next_request, "a request number from the future")
            invariant(sent.keys, "an empty request", request=request)
            most = {"put_begin": self.batches.begin, "put_commit": self.batches.commit}
            invariant(len(sent.keys) <= most.get(sent.verb, self.batches.abort), "request over batch_max")
            invariant(all(self.shard_of(k) == sent.shard for k in sent.keys), "a request spans shards")
            phases = ("beginning", "abandoned") if sent.verb == "put_begin" else ("ending",)
            invariant(self.state in phases, "a request outstanding out of its phase", state=self.state)
        if self.state == "abandoned":
            invariant(self._result is None, "an abandoned save with a result")
            placed_ever = [r.key for begun_ in self._begun.values() for r in begun_.placed]
            invariant(set(commits + aborts) <= set(placed_ever), "an abandoned save ended a key not placed")
            if not self._outstanding:
                ended = sorted(commits + aborts)
                invariant(ended == sorted(placed_ever), "an abandoned save left a placed key not ended")
        if self.state == "done":
            invariant(self._result is not None, "done without a result")
            assert self._result is not None
            r = self._result
            total = r.chunks_saved + r.chunks_existing + r.chunks_failed
            invariant(total == len(self.plan.chunks), "a chunk neither saved, existing nor failed")

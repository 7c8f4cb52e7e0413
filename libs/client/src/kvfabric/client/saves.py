"""The save phases: what each phase of a two-phase save sends and what its answers mean, without
I/O. `kvfabric.client.save_table.SaveTable` (one save's state machine) runs them; its shell is
`AsyncKvClient.save`.

A save publishes chunks of one prompt. Each chunk has one object per required member; an object is
named by its key (`ChunkGroupId.member_key`). The table runs the phases; this module decides what
each phase sends and what its answers mean:

1. **Plan** (`plan_save`): the objects in (chunk, member) order, each with its chunk and its
   parent (the previous chunk's chain hash: eviction drops a prefix's tail first).
2. **Begin**: one `put_begin` per shard carries the objects' specs (`object_specs`). Concurrent
   saves of one client share these requests (`take_batch`): per (verb, shard) one request is in
   flight; what arrives meanwhile rides the next one, whole saves only, never one key twice.
   Each object comes back `placed` (tickets, one per replica), `exists`, or refused (`SaveTally.begun`).
   `not_admitted` (the eviction policy's admission filter refused it; nothing was reserved): the
   chunk is not stored, and neither is any later chunk of the save (`SaveTally.unreachable`: a
   prefix hit can never reach past a chunk that is not stored), so their placed objects are
   aborted without a byte written; each counts under cause `not_admitted`, and the engine
   recomputes them next time, as on a miss.
3. **Write**: every ticket of every placed object is written to its segment. Each write asks for
   a write receipt: a segment that signs them answers as soon as the bytes are stored and
   verified, with its MAC over what it stored, and confirms to the directory in the background.
   One that does not confirms the replica before it answers; a write says how many writes of the
   same request it may gather into one confirm (`confirm_counts`: never more than can be in
   flight at once, or the first confirm would wait its whole gather time for writes queued
   behind it). An object with at least one replica written is committed, the others aborted
   (`SaveTally.written`).
4. **Commit / abort**: one `put_commit` and one `put_abort` per shard (shared like begins). The
   commit carries each committed object's receipts (`with_receipts`): the directory checks them
   and confirms those replicas first, so no confirm round trip sits between writes and commit.

States of an object: planned -> placed | exists | refused (incl. not_admitted); placed ->
unreachable (after a not-admitted chunk: aborted unwritten) | written (>= 1 replica ok) |
write_failed; written -> committed | commit_failed. Invariants (`SaveTally.result`):
- a chunk counts as saved only when none of its objects failed in any phase and at least one was
  written and committed by this save; as existing when all its objects existed and none failed;
  else failed. Every chunk of the save is exactly one of the three.
- every placed object is either committed or aborted (`SaveTable`; an abort that is lost
  expires at the directory after the put's write TTL); nothing half-written becomes visible.
- `bytes_written` counts replica bytes that reached a segment and were confirmed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvfabric.client.hits import SaveResult
from kvfabric.format.ids import ChainHash, ObjectKey
from kvfabric.format.invariant import invariant
from kvfabric.format.key import ChunkGroupId, MemberId
from kvfabric.proto import directory as m

__all__ = [
    "Queued",
    "SavePlan",
    "SaveTally",
    "confirm_counts",
    "object_specs",
    "plan_save",
    "take_batch",
    "with_receipts",
    "write_streams",
]

# Outcome of a write ("ok" or a cause), as `SegmentPool.store` returns it.
OK = "ok"
# Commit statuses that leave the object readable or on its way (the group completes later).
COMMITTED: frozenset[str] = frozenset(("published", "degraded", "waiting_group", "exists"))


@dataclass(frozen=True, slots=True)
class SavePlan:
    """The objects of one save: `keys` in (chunk, member) order, each key's bytes, chunk, parent."""

    keys: tuple[ObjectKey, ...]
    data: dict[ObjectKey, memoryview]
    chunk_of: dict[ObjectKey, int]
    parent_of: dict[ObjectKey, ChainHash]

    @property
    def chunks(self) -> list[int]:
        return sorted(set(self.chunk_of.values()))


def plan_save(
    groups: Sequence[ChunkGroupId],
    members: Sequence[MemberId],
    views: Sequence[Sequence[memoryview]],
    first_chunk: int,
) -> SavePlan:
    """`views[i][j]`: chunk first_chunk+i's bytes for members[j] (the caller checked the shapes)."""
    data: dict[ObjectKey, memoryview] = {}
    chunk_of: dict[ObjectKey, int] = {}
    parent_of: dict[ObjectKey, ChainHash] = {}
    for i, row in enumerate(views):
        chunk = first_chunk + i
        group = groups[chunk]
        parent = groups[chunk - 1].chain_hash if chunk else ChainHash(b"")
        for member, view in zip(members, row, strict=True):
            key = group.member_key(*member).object_key()
            data[key] = view
            chunk_of[key] = chunk
            parent_of[key] = parent
    return SavePlan(tuple(data), data, chunk_of, parent_of)


def object_specs(plan: SavePlan, digests: Sequence[bytes]) -> list[m.ObjectSpec]:
    """The `put_begin` specs of the plan's objects, `digests` in `plan.keys` order."""
    return [
        m.ObjectSpec(key=k, size_bytes=len(plan.data[k]), checksum=d, parent=plan.parent_of[k])
        for k, d in zip(plan.keys, digests, strict=True)
    ]


def confirm_counts(
    placed: Iterable[m.BeginResult], shard_of: Callable[[bytes], int], at_once_max: int
) -> dict[tuple[str, int], int]:
    """Per (segment, shard): how many writes of one `put_begin` reply a segment may gather into one
    confirm (`PutRequest.save_writes`): the reply's writes there, at most `at_once_max` (the writes
    this client runs at once: a segment waiting for more would wait for writes not yet sent)."""
    together = Counter((t.segment_id, shard_of(r.key)) for r in placed for t in r.tickets)
    return {where: min(n, max(1, at_once_max)) for where, n in together.items()}


def with_receipts(
    ok_keys: Sequence[ObjectKey], written: Iterable[tuple[ObjectKey, m.WriteReceipt | None]]
) -> list[tuple[ObjectKey, list[m.WriteReceipt]]]:
    """The put_commit items of `ok_keys`: each key with the receipts its writes got (`written`:
    (key, receipt or None) per write; a write without one was confirmed by its segment)."""
    by_key: dict[ObjectKey, list[m.WriteReceipt]] = {}
    for key, receipt in written:
        if receipt is not None:
            by_key.setdefault(key, []).append(receipt)
    return [(key, by_key.get(key, [])) for key in ok_keys]


def write_streams(writes: Sequence[tuple[Hashable, int]], bytes_target: int) -> list[list[int]]:
    """The writes of a save grouped into pipelined streams (`SegmentPool.write_many`): `writes`
    is (where, size) per write, `where` what one stream shares (segment address, trace id, ...).
    Per `where`, in order, a stream takes writes until it holds `bytes_target` bytes, then the
    next begins: small objects go in one stream (one thread, one round trip), large ones in
    several streams side by side. Returns the writes' indexes per stream; each index once."""
    streams: list[list[int]] = []
    open_stream: dict[Hashable, tuple[list[int], int]] = {}
    for i, (where, size) in enumerate(writes):
        stream, held = open_stream.get(where, ([], bytes_target))
        if held >= bytes_target:
            stream, held = [], 0
            streams.append(stream)
        stream.append(i)
        open_stream[where] = (stream, held + size)
    return streams


T = TypeVar("T")


@dataclass(slots=True)
class Queued(Generic[T]):
    """One save's items waiting for a shared directory request (and whatever the shell keeps)."""

    items: list[T]
    keys: frozenset[Hashable]
    tag: object = None


def take_batch(queue: list[Queued[T]], batch_max: int) -> list[Queued[T]]:
    """Take the entries the next request carries, from the front of `queue` (removed from it): in
    order, while their items fit `batch_max` and no key repeats (a key twice in one request would
    be refused, or answered for one of them only). The first entry always goes (a shell never
    queues more than `batch_max` items in one entry). An entry that does not fit stays, and so do
    those behind it (first come, first served)."""
    taken: list[Queued[T]] = []
    seen: set[Hashable] = set()
    count = 0
    while queue:
        entry = queue[0]
        if taken and (count + len(entry.items) > batch_max or not seen.isdisjoint(entry.keys)):
            break
        taken.append(queue.pop(0))
        seen |= entry.keys
        count += len(entry.items)
    return taken


@dataclass(slots=True)
class SaveTally:
    """What one save's phases answered; `result()` is the save's outcome (module invariants)."""

    plan: SavePlan
    # failed chunk -> the first cause it failed by: `SaveResult.causes` counts chunks, each once
    # (it counted one per failed object and per failed replica write, so its causes did not add
    # up to `chunks_failed`, and the metric said chunks; review, stop 66)
    cause_of: dict[int, str] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)  # chunks
    existing: set[int] = field(default_factory=set)  # chunks with an object that already existed
    existing_keys: set[ObjectKey] = field(default_factory=set)
    committed: set[ObjectKey] = field(default_factory=set)
    bytes_written: int = 0
    not_admitted: set[int] = field(default_factory=set)  # chunks the admission filter refused

    def _fail(self, keys: Iterable[ObjectKey], cause: str) -> None:
        for key in keys:
            self._fail_chunk(self.plan.chunk_of[key], cause)

    def _fail_chunk(self, chunk: int, cause: str) -> None:
        self.failed.add(chunk)
        self.cause_of.setdefault(chunk, cause)

    def refused(self, keys: Sequence[ObjectKey], cause: str) -> None:
        """A whole request (begin or commit) for `keys` got no usable reply: `cause`."""
        self._fail(keys, cause)

    def begun(self, results: Iterable[m.BeginResult]) -> list[m.BeginResult]:
        """The `put_begin` results of this save's keys; returns those placed (to write)."""
        placed: list[m.BeginResult] = []
        for result in results:
            if result.status == "placed":
                placed.append(result)
            elif result.status == "exists":
                self.existing.add(self.plan.chunk_of[result.key])
                self.existing_keys.add(result.key)
            else:
                if result.status == "not_admitted":
                    self.not_admitted.add(self.plan.chunk_of[result.key])
                self._fail((result.key,), result.status)
        return placed

    def unreachable(self, placed: Sequence[m.BeginResult]) -> tuple[list[m.BeginResult], list[ObjectKey]]:
        """After every begin reply: (placed objects to write, keys to abort unwritten). Those of
        the first not-admitted chunk and every later one are not written: without that chunk no
        prefix hit reaches them (counted under cause `not_admitted`)."""
        if not self.not_admitted:
            return list(placed), []
        first = min(self.not_admitted)
        keep = [r for r in placed if self.plan.chunk_of[r.key] < first]
        dropped = [r.key for r in placed if self.plan.chunk_of[r.key] >= first]
        self._fail(dropped, "not_admitted")
        return keep, dropped

    def wrote(
        self, placed: Sequence[m.BeginResult], outcomes: Sequence[str]
    ) -> tuple[list[ObjectKey], list[ObjectKey]]:
        """`outcomes`: one per ticket, in (object, ticket) order. Returns (keys to commit, keys to
        abort): an object is committed when at least one replica was written."""
        if len(outcomes) != sum(len(r.tickets) for r in placed):
            raise ValueError("one write outcome per ticket")
        ok_keys: list[ObjectKey] = []
        bad_keys: list[ObjectKey] = []
        position = 0
        for result in placed:
            mine = outcomes[position : position + len(result.tickets)]
            position += len(result.tickets)
            if any(o == OK for o in mine):
                ok_keys.append(result.key)
                self.bytes_written += len(self.plan.data[result.key]) * sum(o == OK for o in mine)
            else:
                bad_keys.append(result.key)
                self._fail_chunk(self.plan.chunk_of[result.key], mine[0] if mine else "no_ticket")
        return ok_keys, bad_keys

    def commits(self, results: Iterable[m.CommitResult]) -> None:
        """The `put_commit` results of this save's keys."""
        for result in results:
            if result.status in COMMITTED:
                self.committed.add(result.key)
            else:
                self._fail((result.key,), result.status)

    def result(self) -> SaveResult:
        chunks = set(self.plan.chunk_of.values())
        # A chunk counts only when every member object of it is committed or existed: one
        # member a reply did not name (a begin or commit reply without it) left the chunk
        # unpublished, though its other members were committed (review, 2026-12-05: it was
        # counted saved).
        done = self.committed | self.existing_keys
        whole = chunks - {self.plan.chunk_of[k] for k in self.plan.keys if k not in done}
        saved = {self.plan.chunk_of[k] for k in self.committed} & whole - self.failed
        existing = (self.existing & whole) - self.failed - saved
        causes: dict[str, int] = {}
        for chunk in self.failed:
            cause = self.cause_of[chunk]
            causes[cause] = causes.get(cause, 0) + 1
        # A chunk with an object no begin or commit result named (a reply without it).
        unanswered = len(chunks - saved - existing - self.failed)
        if unanswered:
            causes["unanswered"] = causes.get("unanswered", 0) + unanswered
        chunks_failed = len(chunks - saved - existing)
        invariant(sum(causes.values()) == chunks_failed, "save causes do not count the failed chunks")
        return SaveResult(
            chunks_saved=len(saved),
            chunks_existing=len(existing),
            chunks_failed=chunks_failed,
            bytes_written=self.bytes_written,
            causes=causes,
        )

"""`AsyncKvClient`'s saves: admission, then the phases of `kvfabric.client.saves` with this client's
I/O (checksums, shared directory requests per shard, pipelined writes); see `kvfabric.client.aio`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from kvfabric.client.aio_base import ClientBase, Source, directory_cause
from kvfabric.client.busy import retry_busy
from kvfabric.client.hits import SaveResult
from kvfabric.client.saves import (
    SavePlan,
    SaveTally,
    confirm_counts,
    object_specs,
    plan_save,
    with_receipts,
    write_streams,
)
from kvfabric.client.shared_calls import SharedCalls
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import BadRequest, KvfError, Unavailable
from kvfabric.format.ids import ObjectKey
from kvfabric.format.key import ChunkExtras, ChunkGroupId, MemberId, TokenIds
from kvfabric.proto import directory as m

# Save-path directory requests (put_begin, put_commit, put_abort) of one client in flight at once,
# all saves together: half a tenant's default share of the directory's in-flight slots (16), so
# two engines of one tenant pipelining saves fit; past the share, `busy` is retried with a
# backoff (`kvfabric.client.busy`) at most SAVE_BUSY_ATTEMPTS_MAX times within the save's timeout.
SAVE_DIRECTORY_CALLS_MAX: Final = 8
SAVE_BUSY_ATTEMPTS_MAX: Final = 8
# A save of at most this many bytes is hashed on the loop thread (xxh3-128: ~0.03 ms for 2 MiB
# here), not on a save thread: the hop there and back cost 0.05 ms p50, 0.55 ms p90 on this
# loaded 2-core VM (2026-12-01), more than the hash. Larger saves hash off the loop.
SAVE_INLINE_CHECKSUM_BYTES_MAX: Final = 4 << 20
# A save's writes to one segment are pipelined on one connection in streams of about this many
# bytes (`saves.write_streams`): 8 × 256 KiB took 1.3 ms p50 sent / 1.0 ms staged as one stream vs
# 2.0 / 1.5 ms as 8 threads with a connection each (8 × 1 MiB: 4.4 / 2.6 vs 4.4 / 3.0 ms), to one
# segment process below the directory on this loaded 2-core VM (2026-12-02); larger objects keep
# parallel streams.
SAVE_WRITE_STREAM_BYTES_TARGET: Final = 2 << 20

T = TypeVar("T")


def _shard_batches(
    items: Sequence[T], shard_of: Callable[[T], int], batch_max: int = m.PUT_BATCH_OBJECTS_MAX
) -> Iterator[tuple[int, int, list[T]]]:
    """(shard, offset, batch): the items split by shard (first-seen order, each shard's in the
    original order), in batches of at most `batch_max` (a request takes one shard)."""
    by_shard: dict[int, list[T]] = {}
    for item in items:
        by_shard.setdefault(shard_of(item), []).append(item)
    for shard, mine in by_shard.items():
        for start in range(0, len(mine), batch_max):
            yield shard, start, mine[start : start + batch_max]


def _spec_key(spec: m.ObjectSpec) -> bytes:
    return spec.key


def _same_key(key: ObjectKey) -> bytes:
    return key


def _commit_key(item: tuple[ObjectKey, list[m.WriteReceipt]]) -> bytes:
    return item[0]


class SaveMixin(ClientBase):
    """`save_admission`, `save` of `AsyncKvClient`."""

    _save_executor: ThreadPoolExecutor  # the save threads (checksums, writes)
    _save_bytes: int
    _saves_running: int
    _writes_at_once: int  # writes this client runs at once per segment
    _begins: SharedCalls[Any]  # the save-path directory requests, shared by the saves in flight
    _commits: SharedCalls[Any]
    _aborts: SharedCalls[Any]
    _tasks: set[asyncio.Task[Any]]  # running saves

    def save_admission(self, size_bytes: int) -> str | None:
        """Why a save of `size_bytes` would be dropped now, or None when it may start."""
        if self._closed:
            return "closed"
        if self._saves_running >= self.settings.saves_queued_max:
            return "queue_full"
        if self._save_bytes + size_bytes > self.settings.save_inflight_bytes_max:
            return "bytes"
        return None

    async def save(
        self,
        tokens: TokenIds,
        objects: Sequence[Sequence[Source]],
        *,
        first_chunk: int = 0,
        extras: ChunkExtras | None = None,
        trace_id: str | None = None,
    ) -> SaveResult:
        """Publish chunks `first_chunk ..` of `tokens`: `objects[i][j]` is chunk first_chunk+i's
        bytes for member j. Two-phase: put_begin -> write every replica -> put_commit; any failed
        chunk is aborted (nothing half-visible). Never raises for cluster failures."""
        groups = self.chunk_groups(tokens, extras)
        members = self.spec.required_members()
        if first_chunk < 0 or first_chunk + len(objects) > len(groups):
            raise BadRequest(
                f"chunks {first_chunk}..{first_chunk + len(objects)} exceed the {len(groups)} full chunks"
            )
        if any(len(row) != len(members) for row in objects):
            raise BadRequest(f"each chunk needs {len(members)} member objects")
        views = [[memoryview(o).cast("B") for o in row] for row in objects]
        size = sum(len(v) for row in views for v in row)
        refused = self.save_admission(size)
        if refused is not None:
            self.metrics.saves_dropped.labels(refused).inc()
            return SaveResult(chunks_failed=len(objects), causes={refused: len(objects)})
        self._save_bytes += size
        self._saves_running += 1
        self.metrics.inflight_bytes.set(self._save_bytes)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)  # close() waits for running saves before draining NATS
        started = time.perf_counter()
        try:
            return await self._save(groups, members, views, first_chunk, trace_id or uuid.uuid4().hex)
        finally:
            self._save_bytes -= size
            self._saves_running -= 1
            if task is not None:
                self._tasks.discard(task)
            self.metrics.inflight_bytes.set(self._save_bytes)
            self.metrics.save_seconds.observe(time.perf_counter() - started)

    async def _save(
        self,
        groups: list[ChunkGroupId],
        members: tuple[MemberId, ...],
        views: list[list[memoryview]],
        first_chunk: int,
        trace_id: str,
    ) -> SaveResult:
        """The phases of `kvfabric.client.saves` (which decides), with this client's I/O."""
        plan = plan_save(groups, members, views, first_chunk)
        if not plan.keys:
            return SaveResult()
        loop = asyncio.get_running_loop()
        if sum(len(v) for v in plan.data.values()) <= SAVE_INLINE_CHECKSUM_BYTES_MAX:
            digests = [checksum(plan.data[k]) for k in plan.keys]  # cheaper than a thread hop
        else:
            digests = await loop.run_in_executor(
                self._save_executor, lambda: [checksum(plan.data[k]) for k in plan.keys]
            )
        router = self._router()
        try:
            await router.known_shards()
        except Unavailable:
            chunks = len(plan.chunks)
            return SaveResult(chunks_failed=chunks, causes={"directory_unavailable": chunks})
        tally = SaveTally(plan)
        specs = object_specs(plan, digests)
        # Begin: shared with the other saves in flight (`SharedCalls`); each write names the
        # request's trace id and how many of its writes its segment may confirm together.
        writes: list[tuple[m.BeginResult, m.WriteTicket, str, int]] = []
        placed: list[m.BeginResult] = []
        for batch, (reply, batch_trace) in await self._shared(self._begins, specs, _spec_key, trace_id):
            if not isinstance(reply, m.PutBeginReply):
                tally.refused([spec.key for spec in batch], str(reply))
                continue
            mine = {spec.key for spec in batch}
            ours = tally.begun(r for r in reply.results if r.key in mine)
            together = confirm_counts(
                (r for r in reply.results if r.status == "placed"), router.shard_of, self._writes_at_once
            )
            placed += ours
            writes += [
                (r, t, batch_trace, together[t.segment_id, router.shard_of(r.key)])
                for r in ours
                for t in r.tickets
            ]
        placed, unwritten = tally.unreachable(placed)  # past a not-admitted chunk: not written
        if unwritten:
            kept = {id(r) for r in placed}
            writes = [w for w in writes if id(w[0]) in kept]
        outcomes = await self._write_all(plan, writes)
        ok_keys, bad_keys = tally.wrote(placed, [cause for cause, _ in outcomes])
        bad_keys += unwritten
        commits = with_receipts(
            ok_keys,
            ((result.key, receipt) for (result, *_), (_, receipt) in zip(writes, outcomes, strict=True)),
        )
        # Aborts and commits go to their shards concurrently (they name different keys). An abort
        # that fails needs nothing more: its placements expire at the directory (write_ttl_ms).
        ended: tuple[Any, list[tuple[list[tuple[ObjectKey, list[m.WriteReceipt]]], tuple[object, str]]]]
        ended = await asyncio.gather(
            self._shared(self._aborts, bad_keys, _same_key, trace_id),
            self._shared(self._commits, commits, _commit_key, trace_id),
        )
        for items, (reply, _) in ended[1]:
            keys = [key for key, _ in items]
            if not isinstance(reply, m.PutCommitReply):
                tally.refused(keys, str(reply))
                continue
            mine = set(keys)
            tally.commits(r for r in reply.results if r.key in mine)
        result = tally.result()
        self.metrics.saved_tokens.inc(result.chunks_saved * self.spec.layout.tokens_per_chunk)
        self.metrics.saved_bytes.inc(result.bytes_written)
        for cause, n in result.causes.items():
            self.metrics.save_failures.labels(cause).inc(n)
        return result

    async def _write_all(
        self, plan: SavePlan, writes: Sequence[tuple[m.BeginResult, m.WriteTicket, str, int]]
    ) -> list[tuple[str, m.WriteReceipt | None]]:
        """Write every replica of every placed object (bounded by the save executor's threads),
        each answered with its segment's write receipt (the commit carries them); per write, its
        outcome. Each segment's writes are pipelined on one connection (`write_streams`,
        `SegmentPool.write_many`; staged through its staging file when co-located)."""
        loop = asyncio.get_running_loop()
        streams = write_streams(
            [(t.data_addr, t.size_bytes) for _, t, _, _ in writes], SAVE_WRITE_STREAM_BYTES_TARGET
        )

        def run(stream: list[int]) -> list[tuple[str, m.WriteReceipt | None]]:
            (result, ticket, trace, together), *_ = (writes[i] for i in stream)
            if len(stream) == 1:  # on its own connection: staged when co-located
                return [self.pool.write(ticket, plan.data[result.key], trace, together, receipt=True)]
            mine = [
                (t, plan.data[r.key], trace, together)
                for r, t, trace, together in (writes[i] for i in stream)
            ]
            return self.pool.write_many(mine, receipt=True)

        answers = await asyncio.gather(*(loop.run_in_executor(self._save_executor, run, s) for s in streams))
        outcomes: list[tuple[str, m.WriteReceipt | None]] = [("unanswered", None)] * len(writes)
        for stream, answer in zip(streams, answers, strict=True):
            for i, outcome in zip(stream, answer, strict=True):
                outcomes[i] = outcome
        return outcomes

    async def _shared(
        self, calls: SharedCalls[T], items: Sequence[T], key_of: Callable[[T], bytes], trace_id: str
    ) -> list[tuple[list[T], tuple[object, str]]]:
        """`calls`' verb for `items`, split per shard in batches (`_shard_batches`), each sharing a
        request with other saves' (`SharedCalls`), concurrently; (batch, (reply or cause, the
        request's trace id)) in batch order."""
        router = self._router()
        deadline_s = time.monotonic() + self.settings.save_timeout_ms / 1000
        batches = list(_shard_batches(items, lambda item: router.shard_of(key_of(item)), calls.batch_max))
        replies = await asyncio.gather(
            *(
                calls.call(shard, batch, [key_of(item) for item in batch], trace_id, deadline_s)
                for shard, _, batch in batches
            )
        )
        return [(batch, reply) for (_, _, batch), reply in zip(batches, replies, strict=True)]

    def _save_calls(
        self, verb: str, message: Callable[[str, list[Any]], m.DirectoryRequest], batch_max: int
    ) -> SharedCalls[Any]:
        """The shared requests of one save-path verb: `message(request id, items)`."""

        async def send(shard: int, items: list[Any], trace_id: str, deadline_s: float) -> object:
            return await self._directory(trace_id, verb, message(uuid.uuid4().hex, items), shard, deadline_s)

        return SharedCalls(send, batch_max)

    # Bounds this client's save-path directory requests in flight (made on first use, on the loop).
    _save_gate: asyncio.Semaphore | None = None

    async def _directory(
        self,
        trace_id: str,
        verb: str,
        message: m.DirectoryRequest,
        shard: int,
        deadline_s: float | None = None,
    ) -> object:
        """A directory call for saves: the reply, or a cause string (never raises). At most
        `SAVE_DIRECTORY_CALLS_MAX` in flight per client; `busy` backs off and asks again, until
        `deadline_s` (monotonic; by default `save_timeout_ms` from now)."""
        if self.nc is None:
            return "closed"
        if self._save_gate is None:
            self._save_gate = asyncio.Semaphore(SAVE_DIRECTORY_CALLS_MAX)
        gate = self._save_gate
        if deadline_s is None:
            deadline_s = time.monotonic() + self.settings.save_timeout_ms / 1000

        async def ask() -> m.DirectoryReply:
            # The wait for a slot and the request share the save's deadline (TimeoutError below).
            async with asyncio.timeout(max(0.0, deadline_s - time.monotonic())), gate:
                left_s = max(0.001, deadline_s - time.monotonic())
                return await self._ask_directory(verb, message, left_s, trace_id, shard)

        try:
            return await retry_busy(
                ask,
                attempts_max=SAVE_BUSY_ATTEMPTS_MAX,
                deadline_s=deadline_s,
                on_retry=self.metrics.busy_retries.inc,
            )
        except (KvfError, TimeoutError) as exc:
            return directory_cause(exc)

"""`AsyncKvClient`'s saves: admission, then the shell of the save's pure core
(`kvfabric.client.save_table.SaveTable`, which decides): it performs the table's effects with this
client's I/O (the shard map, shared directory requests per shard, pipelined writes) and
feeds their answers back; see `kvfabric.client.aio`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from kvfabric.client.aio_base import ClientBase, Source, directory_cause
from kvfabric.client.busy import retry_busy
from kvfabric.client.hits import SaveResult
from kvfabric.client.save_rate import SaveRate
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
from kvfabric.client.saves import SavePlan, plan_save, write_streams
from kvfabric.client.shared_calls import SENT_ANSWER_GRACE_S, SharedCalls
from kvfabric.format.clock import monotonic_ms
from kvfabric.format.errors import BadRequest, KvfError, Unavailable
from kvfabric.format.ids import ObjectKey
from kvfabric.format.invariant import invariant, unreachable
from kvfabric.format.key import ChunkExtras, ChunkGroupId, MemberId, TokenIds
from kvfabric.proto import directory as m
from kvfabric.proto.common import trace_id_of

# Save-path directory requests (put_begin, put_commit, put_abort) of one client in flight at once,
# all saves together: half a tenant's default share of the directory's in-flight slots (16), so
# two engines of one tenant pipelining saves fit; past the share, `busy` is retried with a
# backoff (`kvfabric.client.busy`) at most SAVE_BUSY_ATTEMPTS_MAX times within the save's timeout.
SAVE_DIRECTORY_CALLS_MAX: Final = 8
SAVE_BUSY_ATTEMPTS_MAX: Final = 8
# A save's writes to one segment are pipelined on one connection in streams of about this many
# bytes (`saves.write_streams`): 8 × 256 KiB took 1.3 ms p50 sent / 1.0 ms staged as one stream vs
# 2.0 / 1.5 ms as 8 threads with a connection each (8 × 1 MiB: 4.4 / 2.6 vs 4.4 / 3.0 ms), to one
# segment process below the directory on this loaded 2-core VM (2026-12-02); larger objects keep
# parallel streams.
SAVE_WRITE_STREAM_BYTES_TARGET: Final = 2 << 20
# A save's phases with a `save_timeout_ms` deadline each (put_begin, writes, put_commit/abort):
# one started ends within this many `save_timeout_ms` (what `AsyncKvClient.close` waits for it).
SAVE_PHASES: Final = 3
# A cancelled save's aborts end within this many `save_timeout_ms` of its cancel, and
# `SENT_ANSWER_GRACE_S` (`aborts_bound_s`): a put_begin out then is answered by its deadline, one,
# and the aborts of what it placed have one more, their own (`_abort_abandoned`); a shared abort or
# commit request is waited for up to its deadline and the grace (`SharedCalls`).
ABORT_PHASES: Final = 2
# Why the chunks of a save still running when `AsyncKvClient.close` stopped waiting for it failed
# (its begin, writes or commit not performed), and why a save asked of a closing client is dropped.
CLOSED: Final = "closed"
# The cause of chunks skipped by the engine's save rate (`ClientSettings.save_bytes_per_s_max`).
SAVE_RATE: Final = "save_rate"
QUEUE_FULL: Final = "queue_full"  # `saves_queued_max` saves were in flight (or handed to the loop)
# `save_inflight_bytes_max` would be passed: by the saves running, or the sources of those handed
# to the loop (`KvClient.save_async`)
SAVE_BYTES: Final = "bytes"

log = logging.getLogger("kvfabric.client")


def aborts_bound_s(save_timeout_ms: int) -> float:
    """How long after its cancel a cancelled save's aborts may still run (`ABORT_PHASES`): what
    `AsyncKvClient.close` waits for them (and, in the same wait, for the saves it cut, each
    ending with its aborts once a write of it still running returns, and the write threads)."""
    return ABORT_PHASES * save_timeout_ms / 1000 + SENT_ANSWER_GRACE_S


class SaveMixin(ClientBase):
    """`save_admission`, `save` of `AsyncKvClient`."""

    _save_executor: ThreadPoolExecutor  # the save threads (writes, with the hashes of sent bytes)
    _save_bytes: int
    _saves_running: int
    _save_rate: SaveRate  # the engine's save bytes per second, under `_save_rate_lock`
    _save_rate_lock: threading.Lock  # the loop's saves and an engine thread's `take_save_rate`
    _save_clock: Callable[[], float]  # monotonic seconds, for the save rate (tests replace it)
    _writes_at_once: int  # writes this client runs at once per segment
    _begins: SharedCalls[Any]  # the save-path directory requests, shared by the saves in flight
    _commits: SharedCalls[Any]
    _aborts: SharedCalls[Any]
    _tasks: set[asyncio.Task[Any]]  # running saves
    _no_saves: asyncio.Event  # set while `_tasks` is empty
    _abandoned: set[asyncio.Task[Any]]  # commits and aborts of cancelled saves, until answered
    _writing: set[asyncio.Future[Any]]  # save write threads running (`close` waits for them)
    # `close` stopped waiting for running saves: no begin, write or commit of theirs is performed
    # any more (answered `closed`), their aborts are held in `_abandoned` (`close` waits for them)
    _saves_cut: bool
    # `close` is past its wait for aborts: no save-path directory request goes (`closed`; a
    # put_abort so is counted, `close_aborts_unfinished`)
    _directory_shut: bool

    def take_save_rate(self, chunk_sizes: Sequence[int]) -> int:
        """Take the engine's save rate for the leading chunks of these sizes it covers now and
        say how many (all of them with no rate): an engine asks before it copies KV out for a
        save, then saves those chunks with `rate_taken=True`. Any thread."""
        with self._save_rate_lock:
            return self._save_rate.admit_leading(chunk_sizes, self._save_clock())

    def peek_save_rate(self, chunk_sizes: Sequence[int]) -> int:
        """How many leading chunks `take_save_rate` would cover now; takes nothing. Any thread."""
        with self._save_rate_lock:
            return self._save_rate.peek_leading(chunk_sizes, self._save_clock())

    def save_admission(self, size_bytes: int) -> str | None:
        """Why a save of `size_bytes` would be dropped now, or None when it may start."""
        if self._closed:
            return CLOSED
        if self._saves_running >= self.settings.saves_queued_max:
            return QUEUE_FULL
        if self._save_bytes + size_bytes > self.settings.save_inflight_bytes_max:
            return SAVE_BYTES
        return None

    async def save(
        self,
        tokens: TokenIds,
        objects: Sequence[Sequence[Source]],
        *,
        first_chunk: int = 0,
        extras: ChunkExtras | None = None,
        trace_id: str | None = None,
        rate_taken: bool = False,
    ) -> SaveResult:
        """Publish chunks `first_chunk ..` of `tokens`: `objects[i][j]` is chunk first_chunk+i's
        bytes for member j. Two-phase: put_begin -> write every replica -> put_commit; any failed
        chunk is aborted (nothing half-visible). Never raises for cluster failures. The engine's
        save rate keeps the leading chunks it covers (the rest: `save_rate`), unless the caller
        took it for these chunks already (`rate_taken`, `take_save_rate`)."""
        groups = self.chunk_groups(tokens, extras)
        members = self.spec.required_members()
        if first_chunk < 0 or first_chunk + len(objects) > len(groups):
            raise BadRequest(
                f"chunks {first_chunk}..{first_chunk + len(objects)} exceed the {len(groups)} full chunks"
            )
        if any(len(row) != len(members) for row in objects):
            raise BadRequest(f"each chunk needs {len(members)} member objects")
        views = [[memoryview(o).cast("B") for o in row] for row in objects]
        chunk_sizes = [sum(len(v) for v in row) for row in views]
        with self._save_rate_lock:
            # The engine's save rate: the leading chunks it covers go, the rest are skipped (a
            # prefix of the ask, so each saved chunk keeps its head). Its bytes are taken only
            # once the save may start (the lock: no engine thread takes them meanwhile).
            now = self._save_clock()
            admitted = len(views) if rate_taken else self._save_rate.peek_leading(chunk_sizes, now)
            size = sum(chunk_sizes[:admitted])
            refused = SAVE_RATE if admitted == 0 and views else self.save_admission(size)
            if refused is None and not rate_taken:
                self._save_rate.admit_leading(chunk_sizes[:admitted], now)
        if refused is not None:
            self.metrics.saves_dropped.labels(refused).inc()
            return SaveResult(chunks_failed=len(objects), causes={refused: len(objects)})
        skipped = len(views) - admitted
        views = views[:admitted]
        self._save_bytes += size
        self._saves_running += 1
        self.metrics.inflight_bytes.set(self._save_bytes)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)  # close() waits for running saves before draining NATS
            self._no_saves.clear()
        started = time.perf_counter()
        try:
            result = await self._save(groups, members, views, first_chunk, trace_id_of(trace_id))
            if skipped:
                self.metrics.save_failures.labels(SAVE_RATE).inc(skipped)
                causes = {**result.causes, SAVE_RATE: result.causes.get(SAVE_RATE, 0) + skipped}
                failed = result.chunks_failed + skipped
                result = dataclasses.replace(result, chunks_failed=failed, causes=causes)
            return result
        finally:
            self._save_bytes -= size
            self._saves_running -= 1
            if task is not None:
                self._tasks.discard(task)
                if not self._tasks:
                    self._no_saves.set()
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
        """The save's `SaveTable` (which decides) fed this client's I/O: each step's effects run
        together, their answers go back in the effects' order, until `Finished`."""
        plan = plan_save(groups, members, views, first_chunk)
        table = SaveTable(
            plan,
            lambda raw: self._router().shard_of(raw),  # the router's map at the time of asking
            self._writes_at_once,
            self.settings.save_timeout_ms,
            SaveBatches(self._begins.batch_max, self._commits.batch_max, self._aborts.batch_max),
        )
        effects = table.step(Open(), monotonic_ms())
        went: dict[int, asyncio.Future[tuple[object, str]]] = {}  # begins out when cancelled
        try:
            while True:
                # Aborts not awaited (keys committed `missing`): sent in the background, held
                # until answered (`close` waits for them), as a cancelled save's are.
                unawaited = [e for e in effects if isinstance(e, SendAbort) and not table.awaits(e.request)]
                for abort in unawaited:
                    if (ending := self._end_call(abort, trace_id)) is not None:
                        self._hold(ending)
                effects = [e for e in effects if e not in unawaited]
                for effect in effects:
                    if isinstance(effect, Finished):
                        if effect.begun:
                            return self._saved(effect.result)
                        for cause, n in effect.result.causes.items():  # (no shard map: counted,
                            self.metrics.save_failures.labels(cause).inc(n)  # review, stop 68)
                        return effect.result
                invariant(effects, "a save step left nothing to do before Finished", state=table.state)
                if len(effects) == 1:  # most steps (hash, write): no task for it
                    events = [await self._perform_save(effects[0], plan, trace_id, went)]
                else:
                    # A commit's or abort's request is a task from here (`_end_call`): cancelled
                    # before its effect's task first ran, it was never sent, yet `abandon` counts
                    # its keys ended (review, 2026-12-06).
                    calls = [self._end_call(e, trace_id) for e in effects]
                    performing = [
                        asyncio.ensure_future(self._perform_save(e, plan, trace_id, went, call))
                        for e, call in zip(effects, calls, strict=True)
                    ]
                    try:
                        events = await asyncio.gather(*performing)
                    except BaseException:  # the answers that came (one shard's begin) are the table's
                        for call in calls:
                            if call is not None and not call.done():
                                self._hold(call)
                        for done in performing:
                            if done.done() and not done.cancelled() and done.exception() is None:
                                more = table.step(done.result(), monotonic_ms())
                                # (the last begin's answer may end the save at once: its aborts go)
                                for effect in more:
                                    if (ending := self._end_call(effect, trace_id)) is not None:
                                        self._hold(ending)
                        raise
                effects = [e for event in events for e in table.step(event, monotonic_ms())]
        except BaseException:
            # Cancelled (the caller gone, the client closing): what the directory placed for
            # this save is aborted in the background, not left reserved until the write TTL
            # (review, 2026-12-05), and so is what a begin that went as it was cancelled places.
            if table.state != "done":
                self._abort_abandoned(table, table.abandon(monotonic_ms()), went, plan, trace_id)
            raise

    def _abort_abandoned(
        self,
        table: SaveTable,
        aborts: list[SendAbort],
        went: dict[int, asyncio.Future[tuple[object, str]]],
        plan: SavePlan,
        trace_id: str,
    ) -> None:
        """Send a cancelled save's aborts from a task of their own, held in `_abandoned` until
        answered: those `abandon` gave, and those its table gives for what each begin request
        that `went` (sent as the save was cancelled) placed, once its answer comes (waited for
        `save_timeout_ms` at most: past every deadline the request went with). Each bounded by
        its deadline; nothing waits for their answers."""
        if not (aborts or went) or self.nc is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the save's coroutine closed with no loop running: they expire
            return

        async def late(request: int, answer: asyncio.Future[tuple[object, str]]) -> None:
            # The answer within one `save_timeout_ms` (past it, its placements expire there);
            # an abort still under way then goes on, held (`_unwithdrawn`), to its own deadline:
            # `ABORT_PHASES` × `save_timeout_ms` from the cancel in all, what `close` waits for
            # (it waited one, and NATS drained under such an abort: placements held to the TTL).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.save_timeout_ms / 1000):
                    reply, trace = await asyncio.shield(answer)
                    more = table.step(BeginAnswered(request, reply, trace), monotonic_ms())
                    await asyncio.gather(*(self._perform_save(a, plan, trace_id) for a in more))

        async def send() -> None:
            await asyncio.gather(
                *(self._perform_save(a, plan, trace_id) for a in aborts),
                *(late(request, answer) for request, answer in went.items()),
            )

        self._hold(loop.create_task(send()))

    def _hold(self, task: asyncio.Task[Any]) -> None:
        """Keep a cancelled save's directory requests (or a cut one's) in `_abandoned` until
        answered (`close` waits for them, with a bound, and counts those still running then;
        each is bounded by its deadline)."""
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)

    def _end_call(self, effect: Effect, trace_id: str) -> asyncio.Task[tuple[object, str]] | None:
        """A commit's or abort's request as a task of its own, started now (None for any other
        effect): it goes even if its save is cancelled meanwhile. Cancelled while queued in
        `SharedCalls` it was withdrawn, never sent, yet `abandon` counts its keys ended (they
        stayed reserved until the write TTL). Bounded by its deadline; held in `_abandoned` once
        the save is cancelled (`_unwithdrawn`), or at once once `close` stopped waiting for the
        running saves (`_saves_cut`; `close` counts it if still running at its bound): a commit
        then is not sent, its keys are aborted instead (answered `closed`: nothing is published
        after `close` gave up on the save)."""
        call: Coroutine[Any, Any, tuple[object, str]]
        if isinstance(effect, SendCommit):
            keys = [key for key, _ in effect.items]
            deadline_s = effect.deadline_ms / 1000
            if self._saves_cut:
                call = self._aborted_instead(effect.shard, keys, trace_id, deadline_s)
            else:
                call = self._commits.call(effect.shard, effect.items, keys, trace_id, deadline_s)
        elif isinstance(effect, SendAbort):
            call = self._aborts.call(
                effect.shard, effect.keys, effect.keys, trace_id, effect.deadline_ms / 1000
            )
        else:
            return None
        task = asyncio.ensure_future(call)
        if self._saves_cut:
            self._hold(task)
        return task

    async def _aborted_instead(
        self, shard: int, keys: list[ObjectKey], trace_id: str, deadline_s: float
    ) -> tuple[object, str]:
        """A commit of a save that `close` stopped waiting for: its keys aborted, not published;
        answered `closed` (the commit's cause)."""
        await self._aborts.call(shard, keys, keys, trace_id, deadline_s)
        return CLOSED, trace_id

    async def _unwithdrawn(self, task: asyncio.Task[tuple[object, str]]) -> tuple[object, str]:
        """An `_end_call`'s answer; cancelled, the call goes on, held in `_abandoned`."""
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._hold(task)
            raise

    async def _perform_save(
        self,
        effect: Effect,
        plan: SavePlan,
        trace_id: str,
        went: dict[int, asyncio.Future[tuple[object, str]]] | None = None,
        call: asyncio.Task[tuple[object, str]] | None = None,
    ) -> SaveEvent:
        """One effect of the save's table, answered with its event (never raises for the cluster).
        A begin cancelled after its request went leaves its answer to come in `went`. `call`: a
        commit's or abort's request started already (`_end_call`). Once `close` stopped waiting
        for the running saves (`_saves_cut`), a begin or the writes are not performed: answered
        `closed` (a save that overran its deadlines, or whose loop was stalled, wrote after
        `close` returned)."""
        if self._saves_cut and isinstance(effect, SendBegin):
            return BeginAnswered(effect.request, CLOSED, trace_id)  # nothing placed for it
        if self._saves_cut and isinstance(effect, WriteReplicas):
            return WritesDone(((CLOSED, None),) * len(effect.writes))  # its keys aborted
        if isinstance(effect, PrepareBegins):
            # No checksum at put_begin: each segment hashes what it stored and the first replica's
            # hash becomes the object's (`ObjectSpec.checksum`); sent bytes carry the writer's
            # hash in the PUT (hashed in the write thread, beside the other writes), staged ones
            # none (the segment reads this process's own pages). A hash of every object before
            # put_begin was 5-7 ms of a 16 MiB × 8 co-located save (2026-12-05).
            digests = [b""] * len(plan.keys)
            router = self._router()
            try:
                await router.known_shards()
            except Unavailable:
                return ShardMapUnknown()
            return Prepared(tuple(digests))
        if isinstance(effect, SendBegin):
            # Shared with the other saves in flight (`SharedCalls`): the answer names the trace id
            # the request went with (its writes name it too).
            keys = [spec.key for spec in effect.specs]
            request = effect.request

            def sent(answer: asyncio.Future[tuple[object, str]]) -> None:
                if went is not None:
                    went[request] = answer

            reply, trace = await self._begins.call(
                effect.shard, effect.specs, keys, trace_id, effect.deadline_ms / 1000, sent
            )
            return BeginAnswered(request, reply, trace)
        if isinstance(effect, WriteReplicas):
            return WritesDone(tuple(await self._write_all(plan, effect.writes)))
        if isinstance(effect, SendCommit | SendAbort):
            # (an abort that fails needs nothing more: its placements expire at the directory)
            started = call or self._end_call(effect, trace_id)
            assert started is not None
            reply, _ = await self._unwithdrawn(started)
            return EndAnswered(effect.request, reply)
        unreachable("an effect the save shell does not perform", effect=effect)

    def _saved(self, result: SaveResult) -> SaveResult:
        self.metrics.saved_tokens.inc(result.chunks_saved * self.spec.layout.tokens_per_chunk)
        self.metrics.saved_bytes.inc(result.bytes_written)
        for cause, n in result.causes.items():
            self.metrics.save_failures.labels(cause).inc(n)
        return result

    async def _write_all(
        self, plan: SavePlan, writes: Sequence[Write]
    ) -> list[tuple[str, m.WriteReceipt | None]]:
        """Write every replica of every placed object (bounded by the save executor's threads),
        each answered with its segment's write receipt (the commit carries them); per write, its
        outcome. Each segment's writes are pipelined on one connection (`write_streams`,
        `SegmentPool.write_many`; staged through its staging file when co-located)."""
        streams = write_streams(
            [(w.ticket.data_addr, w.ticket.size_bytes) for w in writes], SAVE_WRITE_STREAM_BYTES_TARGET
        )

        # The write phase has the save's timeout, as its directory phases do: a stream still
        # queued or writing then is cut (`timeout`; a trickling segment held a save, and the
        # caller's buffers, for a socket timeout per write before; review, 2026-12-05).
        cut_at_s = time.monotonic() + self.settings.save_timeout_ms / 1000

        def run(stream: list[int]) -> list[tuple[str, m.WriteReceipt | None]]:
            mine = [writes[i] for i in stream]
            if time.monotonic() >= cut_at_s:  # queued past the phase's deadline: never sent
                return [("timeout", None)] * len(mine)
            if len(mine) == 1:  # on its own connection: staged when co-located
                w = mine[0]
                return [
                    self.pool.write(
                        w.ticket, plan.data[w.key], w.trace_id, w.together, receipt=True, cut_at_s=cut_at_s
                    )
                ]
            return self.pool.write_many(
                [(w.ticket, plan.data[w.key], w.trace_id, w.together) for w in mine],
                receipt=True,
                cut_at_s=cut_at_s,
            )

        # Concurrent futures, not `run_in_executor`'s: cancelling this save must not return
        # while a write thread still reads the caller's buffers (an asyncio future wrapping a
        # running write is "cancelled" at once, the thread going on; review, 2026-12-05).
        running: list[concurrent.futures.Future[list[tuple[str, m.WriteReceipt | None]]]] = []
        for stream in streams:
            try:
                running.append(self._save_executor.submit(run, stream))
            except RuntimeError:  # the client is closing (its executor shut down): never sent
                cancelled: concurrent.futures.Future[list[tuple[str, m.WriteReceipt | None]]]
                cancelled = concurrent.futures.Future()
                cancelled.cancel()  # answered `closed` below, as a queued write cancelled then is
                running.append(cancelled)
        # Each thread's future on the loop is in `_writing` until it ends: `close` waits for them
        # before it shuts the directory (a cut save's aborts go once its writes returned).
        on_loop = [asyncio.wrap_future(f) for f in running]
        for waited in on_loop:
            self._writing.add(waited)
            waited.add_done_callback(self._writing.discard)
        try:
            await asyncio.wait(on_loop)
        except BaseException:
            for f in running:
                f.cancel()  # those not started yet never will
            await _wait_for_threads(running, self.settings.save_timeout_ms / 1000)
            raise
        answers: list[list[tuple[str, m.WriteReceipt | None]]] = []
        for stream, f in zip(streams, running, strict=True):
            if f.cancelled():  # the client closed (its executor cancelled what was queued)
                answers.append([("closed", None)] * len(stream))
            else:
                answers.append(f.result())
        outcomes: list[tuple[str, m.WriteReceipt | None]] = [("unanswered", None)] * len(writes)
        for stream, answer in zip(streams, answers, strict=True):
            for i, outcome in zip(stream, answer, strict=True):
                outcomes[i] = outcome
        return outcomes

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
        `deadline_s` (monotonic; by default `save_timeout_ms` from now). Once `close` is past its
        wait for aborts (`_directory_shut`): `closed` at once, never sent (a put_abort so is
        counted in `close_aborts_unfinished`: its keys stay reserved until the write TTL)."""
        if self.nc is None or self._directory_shut:
            if self._directory_shut and verb == "put_abort":
                self.metrics.close_aborts_unfinished.inc()
            return CLOSED
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


async def _wait_for_threads(running: Sequence[concurrent.futures.Future[Any]], timeout_s: float) -> None:
    """Wait (at most `timeout_s`, whatever cancels the wait meanwhile) for the write threads
    already running: until they end they read the caller's buffers. One still running after
    that is logged (its segment's socket timeouts bound it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [f for f in running if not f.done()]
        if not left:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            log.error("kvfabric: a cancelled save has %d writes running after %.1f s", len(left), timeout_s)
            return
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([asyncio.wrap_future(f) for f in left], timeout=remaining)

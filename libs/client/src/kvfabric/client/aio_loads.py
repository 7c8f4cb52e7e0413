"""`AsyncKvClient`'s loads: verified copies of a hit's chunks into the engine's buffers, coalesced
by the `LoadTable` whose effects run here (loop thread), transfers on worker threads; see
`kvfabric.client.aio`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from kvfabric.client.aio_base import ClientBase, Destination
from kvfabric.client.hits import Hit, LoadResult
from kvfabric.core.client_loads import (
    Busy,
    CancelTransfer,
    Deliver,
    DestId,
    Effect,
    Fail,
    LoadTable,
    ReleaseStaging,
    StartTransfer,
    TransferId,
)
from kvfabric.dataplane.frames import READS_MAX
from kvfabric.dataplane.scatter import GateClosed, ScatterDest, WriteGate, scatter_dests
from kvfabric.format.clock import monotonic_ms as _now_ms
from kvfabric.format.errors import BadRequest, StaleGeneration
from kvfabric.format.generations import RequestGeneration
from kvfabric.proto import directory as m

# Objects per data-plane request when a load reads several from one segment: small objects share
# a request (fewer round trips); large ones go one or two a request, so several requests run at
# once on separate connections and worker threads (the segment sends while this side receives
# and hashes). A request carries at most `FETCH_BATCH_BYTES_TARGET` bytes unless one object is
# larger. (Co-located reads split the same way: measured, batching them on one thread was no
# better, 3.75 vs 4.35 GB/s at 1 MiB and 5.75 vs 5.23 at 4 MiB, within this VM's noise.)
FETCH_BATCH_OBJECTS_MAX: Final = 8
FETCH_BATCH_BYTES_TARGET: Final = 2 << 20
# A co-located request of at most this many bytes is read on the loop thread (`SegmentPool.
# fetch_local_now`: an arena copy with the hash fused, no round trip) instead of a worker thread:
# the hop there and back cost about 0.5 ms p50 here, a 2 MiB copy about 0.3 ms (2026-12-02). The
# bound is per flush, not per request: the loop is held for at most this many bytes of copies a
# flush (a 16 MiB load was copied whole on the loop, 3-19 ms, review of stop 33); the rest of a
# larger load still goes to the worker threads and overlaps.
LOCAL_INLINE_BYTES_MAX: Final = 2 << 20
# A load of at most this many bytes in all (and at most `READS_MAX` objects) whose first replicas
# lie on one segment runs on the engine's own thread (`load_now`; the engine waits for it anyway:
# its thread is idle): co-located, copied from the mapped arena; otherwise one data request,
# streamed and verified as it lands. A whole prompt's hit in vLLM (bench.hit_floor: 1-3K tokens
# of the tiny Llama are 4-12 MiB) then no longer takes the hops engine -> loop -> worker threads
# -> loop -> engine: co-located 2.3-5.6 -> 1.3-3.5 ms, remote 4.8-14.9 -> 3.4-8.1 ms (one
# request beat 2 MiB requests on parallel connections on this 2-core VM; bench/results/
# hit_floor.md). Larger loads still go to the worker threads, whose reads overlap where there
# are cores.
LOAD_NOW_BYTES_MAX: Final = 16 << 20
# A larger load whose first replicas are all in one co-located segment's mapped arena is copied on
# the engine's thread too, up to this many bytes: the worker threads' reads do not overlap on
# this 2-core VM (one thread copying 8 × 4 MiB: 5.7 ms p50 vs 9.3 ms the table's way; 8 × 16 MiB
# 16.1 vs 21.6 ms; 40 alternating loads each, one process, 2026-12-02, docs/engines.md "Sixth
# pass"). A remote load past `LOAD_NOW_BYTES_MAX` keeps the table's parallel requests.
LOAD_NOW_LOCAL_BYTES_MAX: Final = 1 << 30


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[str]
    dest: ScatterDest  # the engine's buffers for this object, under the load's gate
    deadline_ms: int  # the load's (client monotonic clock, `_now_ms`)


@dataclass(slots=True)
class _Target:
    """Where a transfer writes: straight into the buffers of the waiter that started it."""

    load_id: Any
    dest: ScatterDest


_UNUSED: Final = "unused"  # an object not waited for: a chunk before it failed (`_UsefulLeft`)


class _UsefulLeft:
    """Whether a load still waits for an object it can use: one pending in a chunk before the
    load's first failed chunk (the result is the verified prefix: nothing from that chunk on is
    used). It waited for every object up to `load_timeout_ms`, so a chunk refused at once before
    others on a slow segment cost the engine the whole timeout, then a recompute (review, stop
    67). O(1) a settled object, the chunks' counts walked once as the first failure moves down."""

    def __init__(self, first_chunk: int, n_chunks: int) -> None:
        self._first_chunk = first_chunk
        self._pending = [0] * n_chunks  # objects pending per chunk
        self._failed = n_chunks  # the first failed chunk (from `first_chunk`); n_chunks: none
        self._useful = 0  # objects pending before it
        self.settled = asyncio.Event()  # set while none is

    def add(self, chunk: int, future: asyncio.Future[str]) -> None:
        i = chunk - self._first_chunk
        self._pending[i] += 1
        if i < self._failed:
            self._useful += 1
            self.settled.clear()
        future.add_done_callback(lambda done: self._done(i, done))

    def _done(self, i: int, future: asyncio.Future[str]) -> None:
        self._pending[i] -= 1
        if i < self._failed:
            self._useful -= 1
            if future.cancelled() or future.result() != "ok":  # chunk i on: of no use now
                self._useful -= sum(self._pending[i : self._failed])
                self._failed = i
        if self._useful == 0:
            self.settled.set()


class LoadMixin(ClientBase):
    """`load`, `load_now` of `AsyncKvClient`, and the load table's effects."""

    table: LoadTable
    _executor: ThreadPoolExecutor  # the transfer threads
    _waiters: dict[Any, _Waiter]
    _targets: dict[TransferId, _Target]  # StartTransfer .. ReleaseStaging
    _locations: dict[Any, m.ObjectLocation]  # object id -> where (for StartTransfer)
    _load_seq: itertools.count[int]
    _generations: itertools.count[int]
    _capacity: asyncio.Event  # set whenever a transfer ends (ReleaseStaging: room again)
    # not dispatched yet: (transfer, where, the starter's buffers, the starter's deadline ms)
    _starting: list[tuple[TransferId, m.ObjectLocation, ScatterDest, int]]

    async def load(
        self,
        hit: Hit,
        dests: Sequence[Sequence[Destination]],
        *,
        first_chunk: int = 0,
        dest_ids: Sequence[Sequence[DestId]] | None = None,
        gate: WriteGate | None = None,
    ) -> LoadResult:
        """Copy chunks `first_chunk ..` of `hit` into `dests[i][j]` (chunk first_chunk+i, member
        j), verifying every checksum. Returns the verified whole-chunk prefix, in tokens from 0.

        `dest_ids` name the engine's buffers (e.g. paged-KV block ids) so the fence can tell a
        reused buffer; by default each call's buffers are anonymous. `gate`: the loan of `dests`
        (made here when not given); the caller may close it from any thread to take the buffers
        back at once (`KvClient.load` does when the loop is late). Raises `BadRequest` only for
        caller bugs (shapes, sizes)."""
        if not 0 <= first_chunk <= hit.chunks:
            raise BadRequest(f"first_chunk {first_chunk} outside the hit's 0..{hit.chunks} chunks")
        chunks = hit.objects[first_chunk:]
        if len(dests) > len(chunks) or any(len(d) != len(hit.members) for d in dests):
            raise BadRequest(f"dests must be at most {len(chunks)} chunks of {len(hit.members)} members each")
        chunks = chunks[: len(dests)]
        # The engine lends its buffers until this call returns: transfers write into them
        # under `gate`, which the finally below closes (after it, nothing writes into them).
        gate = gate or WriteGate()
        views = [
            scatter_dests(row, [loc.size_bytes for loc in locs], gate)
            for row, locs in zip(dests, chunks, strict=True)
        ]
        tpc = hit.tokens_per_chunk
        if not chunks:
            return LoadResult(first_chunk * tpc, 0, 0)
        if self._closed:
            self.metrics.fallbacks.labels("closed").inc()
            return LoadResult(
                first_chunk * tpc, 0, 0, tuple(range(first_chunk, first_chunk + len(chunks))), "closed"
            )
        started = time.perf_counter()
        self._perform(self.table.expire(_now_ms()))  # also trims the table's deadline heap
        seq = next(self._load_seq)
        generation = RequestGeneration(next(self._generations))
        deadline_ms = _now_ms() + self.settings.load_timeout_ms
        outcomes: dict[tuple[int, int], asyncio.Future[str]] = {}
        anonymous: list[DestId] = []
        waits = [0.0]  # seconds this load queued for transfer room
        useful = _UsefulLeft(first_chunk, len(chunks))
        loop = asyncio.get_running_loop()
        try:
            for i, locs in enumerate(chunks):
                chunk = first_chunk + i
                for j, loc in enumerate(locs):
                    load_id = (seq, chunk, j)
                    if dest_ids is not None:
                        dest_id = dest_ids[i][j]
                    else:
                        dest_id = ("anonymous", seq, chunk, j)
                        anonymous.append(dest_id)
                    object_id = (hit.groups[chunk], hit.members[j])
                    future: asyncio.Future[str] = loop.create_future()
                    outcomes[(chunk, j)] = future
                    useful.add(chunk, future)
                    self._waiters[load_id] = _Waiter(future, views[i][j], deadline_ms)
                    await self._want(load_id, generation, object_id, dest_id, loc, deadline_ms, waits)
                if any(f.done() and f.result() != "ok" for f in outcomes.values()):
                    break  # a chunk already failed: later ones would not be used
            self._flush_starts()
            if any(not f.done() for f in outcomes.values()):
                # until every object it can still use is in (those after a failed chunk are
                # not waited for: cancelled below, their transfers fenced), and every transfer
                # into its buffers that other loads joined has landed (they copy from these
                # buffers: left early, their objects failed `cancelled`; review, stop 67)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, (deadline_ms - _now_ms()) / 1000)):
                        await useful.settled.wait()
                        while lent := [f for k, f in outcomes.items() if not f.done() and self._lent(seq, k)]:
                            await asyncio.wait(lent, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Every waiter of this load ends here (also when this coroutine is cancelled): after
            # the gate closes no transfer writes into this load's buffers (one that is still
            # running stops at its next block), and the table fences any later delivery.
            gate.close()
            self._flush_starts()  # started transfers must be answered (and release their target)
            timed_out = _now_ms() >= deadline_ms
            unfinished = "timeout" if timed_out else _UNUSED if useful.settled.is_set() else "cancelled"
            for (chunk, j), future in outcomes.items():
                if not future.done():
                    load_id = (seq, chunk, j)
                    self._perform(self.table.cancel(load_id))
                    self._finish(load_id, unfinished)
            for dest_id in anonymous:
                self.table.forget_dest(dest_id)
        return self._load_result(hit, first_chunk, len(chunks), outcomes, started, waits[0])

    def load_now(
        self, hit: Hit, dests: Sequence[Sequence[Destination]], *, first_chunk: int = 0
    ) -> LoadResult | None:
        """`load` done on the calling thread, with no thread hop, for a hit of chunks
        `first_chunk ..` of at most `LOAD_NOW_BYTES_MAX` bytes in all (and no more than
        `load_inflight_bytes_max`, at most `READS_MAX` objects) whose first replicas lie on one
        segment, or of at most `LOAD_NOW_LOCAL_BYTES_MAX` when that segment's mapped arena holds
        them all (copied here, or else the table's way). Co-located, a pooled connection that
        maps the arena copies them (`SegmentPool.fetch_local_now`: no I/O); else one data
        request for all of them on this thread (`SegmentPool.fetch_many`, what a worker thread
        would run for them, the next replicas tried within `load_timeout_ms`, through the pool's
        per-segment connection bound). Returns the verified whole-chunk prefix as `load` does (a
        chunk that did not verify and the ones after it failed); None when the hit is not such a
        load (the caller runs `load`). Thread-safe (the sync facade calls it from the engine's
        thread): it touches no load-table state, so such loads are
        neither coalesced with concurrent loads of the same objects nor counted in the table's
        in-flight bounds (they write only into the caller's buffers). Every copy and transfer
        ends before it returns: nothing writes into `dests` afterwards (invariant 3)."""
        if self._closed or not 0 <= first_chunk <= hit.chunks:
            return None
        chunks = hit.objects[first_chunk:]
        if len(dests) > len(chunks) or any(len(d) != len(hit.members) for d in dests):
            return None  # `load` raises BadRequest for it
        chunks = chunks[: len(dests)]
        locations = [loc for row in chunks for loc in row]
        total = sum(loc.size_bytes for loc in locations)
        if not locations or len(locations) > READS_MAX:
            return None  # the table's way: bounded in flight, waits for room, coalesced
        local_only = total > min(LOAD_NOW_BYTES_MAX, self.settings.load_inflight_bytes_max)
        if local_only and (not self.settings.use_shm or total > LOAD_NOW_LOCAL_BYTES_MAX):
            return None
        if len({loc.replicas[0].data_addr if loc.replicas else "" for loc in locations}) != 1:
            return None
        started = time.perf_counter()
        gate = WriteGate()
        try:
            views = [
                view
                for row, locs in zip(dests, chunks, strict=True)
                for view in scatter_dests(row, [loc.size_bytes for loc in locs], gate)
            ]
            causes = self.pool.fetch_local_now(locations, views) if self.settings.use_shm else None
            if causes is None and local_only:
                return None  # not all in a mapped arena (or not all read ok): the table's way
            if causes is None:
                deadline_s = time.monotonic() + self.settings.load_timeout_ms / 1000
                causes = self.pool.fetch_many(
                    locations, views, self.settings.replica_attempts_max, deadline_s
                )
        finally:
            gate.close()
        # The verified whole-chunk prefix (as `load` reports it); a chunk with an object that did
        # not read ok, and every chunk after it, failed (recomputed by the engine).
        width = len(hit.members)
        rows = [causes[i * width : (i + 1) * width] for i in range(len(chunks))]
        loaded = next((i for i, row in enumerate(rows) if any(c != "ok" for c in row)), len(rows))
        cause = next((c for c in rows[loaded] if c != "ok"), "") if loaded < len(rows) else ""
        tpc = hit.tokens_per_chunk
        nbytes = sum(loc.size_bytes for row in chunks[:loaded] for loc in row)
        self.metrics.load_seconds.observe(time.perf_counter() - started)
        self.metrics.queued_seconds.observe(0.0)
        self.metrics.loaded_tokens.inc(loaded * tpc)
        self.metrics.prefill_tokens_saved.inc(loaded * tpc)
        self.metrics.loaded_bytes.inc(nbytes)
        if cause:
            self.metrics.fallbacks.labels(cause).inc()
        failed = tuple(range(first_chunk + loaded, first_chunk + len(chunks)))
        return LoadResult((first_chunk + loaded) * tpc, loaded, nbytes, failed, cause)

    async def _want(
        self,
        load_id: Any,
        generation: RequestGeneration,
        object_id: Any,
        dest_id: DestId,
        location: m.ObjectLocation,
        deadline_ms: int,
        waits: list[float],
    ) -> None:
        """Register one waiter; while the table is full (Busy), wait for a transfer to release
        its target, up to the load's deadline (then the waiter ends "busy")."""
        while True:
            self._locations[object_id] = location  # read by StartTransfer, if this want starts one
            try:
                effects = self.table.want(
                    load_id,
                    generation,
                    object_id,
                    dest_id,
                    now_ms=_now_ms(),
                    deadline_ms=deadline_ms,
                    size_bytes=location.size_bytes,
                )
            except (StaleGeneration, BadRequest):
                # Refused for good (an object larger than load_inflight_bytes_max): waiting for
                # room would only burn the deadline.
                self._locations.pop(object_id, None)
                self._finish(load_id, "busy")
                return
            if not (len(effects) == 1 and isinstance(effects[0], Busy)):
                self._perform(effects, starter=load_id)  # a StartTransfer takes the location
                self._locations.pop(object_id, None)
                return
            self._locations.pop(object_id, None)
            remaining_s = (deadline_ms - _now_ms()) / 1000
            if remaining_s <= 0:
                self._finish(load_id, "busy")
                return
            self._flush_starts()  # what this load started so far must run before we wait for room
            self._capacity.clear()
            queued = time.perf_counter()
            try:
                await asyncio.wait_for(self._capacity.wait(), remaining_s)
            except TimeoutError:
                self._finish(load_id, "busy")
                return
            finally:
                waits[0] += time.perf_counter() - queued

    def _load_result(
        self,
        hit: Hit,
        first_chunk: int,
        n_chunks: int,
        outcomes: dict[tuple[int, int], asyncio.Future[str]],
        started: float,
        queued_s: float,
    ) -> LoadResult:
        loaded = 0
        cause = ""
        failed: list[int] = []
        for i in range(n_chunks):
            chunk = first_chunk + i
            results = [
                outcomes[(chunk, j)].result() if (chunk, j) in outcomes else "skipped"
                for j in range(len(hit.members))
            ]
            # (a member not waited for, after another failed, is not the chunk's cause)
            bad = next((r for r in results if r not in ("ok", _UNUSED)), None)
            bad = bad or next((r for r in results if r != "ok"), None)
            if bad is None and not failed:
                loaded += 1
                continue
            if bad is not None and not cause:
                cause = bad if bad != "skipped" else "busy"
            failed.append(chunk)
        nbytes = sum(o.size_bytes for row in hit.objects[first_chunk : first_chunk + loaded] for o in row)
        tokens = (first_chunk + loaded) * hit.tokens_per_chunk
        self.metrics.load_seconds.observe(time.perf_counter() - started)
        self.metrics.queued_seconds.observe(queued_s)
        self.metrics.loaded_tokens.inc(loaded * hit.tokens_per_chunk)
        self.metrics.prefill_tokens_saved.inc(loaded * hit.tokens_per_chunk)
        self.metrics.loaded_bytes.inc(nbytes)
        if cause:
            self.metrics.fallbacks.labels(cause).inc()
        return LoadResult(tokens, loaded, nbytes, tuple(failed), cause)

    # ---- effects of the load table (loop thread only) --------------------------------------

    def _perform(self, effects: list[Effect], starter: Any = None) -> None:
        """Carry out the table's effects; `starter` is the load id whose `want` they answer
        (a StartTransfer writes into that waiter's buffers)."""
        for effect in effects:
            if isinstance(effect, StartTransfer):
                self._start_transfer(effect, starter)
            elif isinstance(effect, Deliver):
                self._deliver(effect)
            elif isinstance(effect, Fail):
                self._finish(effect.load_id, effect.cause)
            elif isinstance(effect, Busy):
                self._finish(effect.load_id, "busy")
            elif isinstance(effect, ReleaseStaging):
                self._targets.pop(effect.transfer_id, None)
                self._capacity.set()  # loads waiting for room may retry
            elif isinstance(effect, CancelTransfer):
                pass  # a blocking transfer cannot be interrupted; it is bounded by its timeout

    def _lent(self, seq: int, chunk_member: tuple[int, int]) -> bool:
        """Whether waiter (seq, chunk, member) started a transfer that other loads joined: it
        writes into this waiter's buffers, and they copy from them."""
        load_id = (seq, *chunk_member)
        transfer_id = self.table.shared_transfer(load_id)
        target = self._targets.get(transfer_id) if transfer_id is not None else None
        return target is not None and target.load_id == load_id

    def _finish(self, load_id: Any, outcome: str) -> None:
        waiter = self._waiters.pop(load_id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(outcome)

    def _start_transfer(self, effect: StartTransfer, starter: Any) -> None:
        location = self._locations.pop(effect.object_id)
        waiter = self._waiters[starter]  # the want that started it: its buffers, its gate
        self._targets[effect.transfer_id] = _Target(starter, waiter.dest)
        self._starting.append((effect.transfer_id, location, waiter.dest, waiter.deadline_ms))

    def _flush_starts(self) -> None:
        """Dispatch the transfers started since the last flush to the worker threads, batched
        per segment (see `FETCH_BATCH_BYTES_TARGET`). Every one is answered once."""
        if not self._starting:
            return
        starting, self._starting = self._starting, []
        by_segment: dict[str, list[tuple[TransferId, m.ObjectLocation, ScatterDest, int]]] = {}
        for item in starting:
            addr = item[1].replicas[0].data_addr if item[1].replicas else ""
            by_segment.setdefault(addr, []).append(item)
        loop = asyncio.get_running_loop()
        attempts = self.settings.replica_attempts_max
        inline_left = LOCAL_INLINE_BYTES_MAX  # copies this flush may make on the loop

        def done(transfer_ids: list[TransferId], causes: list[str]) -> None:
            for transfer_id, cause in zip(transfer_ids, causes, strict=True):
                self._perform(self.table.transfer_done(transfer_id, cause == "ok", cause))

        for items in by_segment.values():
            largest = max(item[1].size_bytes for item in items)
            per_request = max(1, min(FETCH_BATCH_OBJECTS_MAX, FETCH_BATCH_BYTES_TARGET // max(1, largest)))
            for start in range(0, len(items), per_request):
                batch = items[start : start + per_request]
                transfer_ids = [item[0] for item in batch]
                batch_bytes = sum(item[1].size_bytes for item in batch)
                if self.settings.use_shm and batch_bytes <= inline_left:
                    # Small co-located reads: copied from the arena here, no hop to a worker thread.
                    causes_now = self.pool.fetch_local_now([it[1] for it in batch], [it[2] for it in batch])
                    if causes_now is not None:
                        inline_left -= batch_bytes
                        loop.call_soon(done, transfer_ids, causes_now)  # answered after this flush
                        continue

                def run(batch: list[tuple[TransferId, m.ObjectLocation, ScatterDest, int]] = batch) -> None:
                    ids = [item[0] for item in batch]
                    if all(dest.gate is not None and not dest.gate.is_open for _, _, dest, _ in batch):
                        # Their loads ended before a worker got to them: nothing to read for.
                        with contextlib.suppress(RuntimeError):
                            loop.call_soon_threadsafe(done, ids, ["cancelled"] * len(batch))
                        return
                    try:
                        causes = self.pool.fetch_many(
                            [loc for _, loc, _, _ in batch],
                            [st for _, _, st, _ in batch],
                            attempts,
                            max(item[3] for item in batch) / 1000,  # a replica's share of it
                        )
                    except Exception:  # never leave a transfer unanswered
                        causes = ["transport_error"] * len(batch)
                    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                        loop.call_soon_threadsafe(done, ids, causes)

                try:
                    self._executor.submit(run)
                except RuntimeError:  # executor shut down
                    loop.call_soon(done, transfer_ids, ["closed"] * len(batch))

    def _deliver(self, effect: Deliver) -> None:
        target = self._targets[effect.transfer_id]
        waiter = self._waiters.get(effect.load_id)
        if waiter is None or not self.table.may_write(effect.load_id, effect.generation, effect.dest_id):
            return
        if target.dest is not waiter.dest:
            # A load that joined another's transfer copies from that load's buffers, which are
            # still lent only while its gate is open: its owner may close it from another thread
            # (a sync load's engine thread), so each piece is copied under both gates.
            try:
                waiter.dest.copy_from(target.dest)
            except GateClosed:
                self._perform(self.table.cancel(effect.load_id))
                self._finish(effect.load_id, "cancelled")
                return
        self._perform(self.table.delivered(effect.load_id, effect.generation, effect.dest_id))
        self._finish(effect.load_id, "ok")

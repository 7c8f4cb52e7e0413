"""The synchronous facade engines call from their worker threads.

`KvClient` owns an event loop on a daemon thread and runs an `AsyncKvClient` there. Every call
is bounded: lookups by `lookup_timeout_ms`, loads by `load_timeout_ms` (plus a grace for the
loop), so an engine thread never hangs on the cluster. `save_async` never blocks: it copies
nothing, checks admission, and hands the save to the loop (the caller gives up its buffers).
If the cluster cannot be reached at start, the client runs *disabled*: every lookup is a miss
(cause "closed"), every save is dropped, and the engine simply recomputes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvfabric.client.aio import AsyncKvClient, Destination, EngineSpec, Source
from kvfabric.client.hits import Hit, LoadResult, SaveResult
from kvfabric.client.metrics import ClientMetrics
from kvfabric.client.settings import ClientSettings
from kvfabric.client.threads import thread_placement
from kvfabric.core.client_loads import DestId
from kvfabric.dataplane.scatter import WriteGate
from kvfabric.format.errors import Unavailable
from kvfabric.format.key import ChunkExtras, TokenIds

__all__ = ["KvClient"]

T = TypeVar("T")
_GRACE_S = 5.0  # beyond a call's own timeout: the loop thread is late only if the process is stuck


class KvClient:
    """Thread-safe blocking client; one per engine process (or worker)."""

    def __init__(
        self, settings: ClientSettings, spec: EngineSpec, *, metrics: ClientMetrics | None = None
    ) -> None:
        self.settings = settings
        self.aio = AsyncKvClient(settings, spec, metrics=metrics)
        self.metrics = self.aio.metrics
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_loop,
            args=(thread_placement(settings.thread_cpus, background=False),),  # in the creating thread
            name="kvf-client-loop",
            daemon=True,
        )
        self._thread.start()
        self.enabled = True
        self._releases: set[concurrent.futures.Future[None]] = set()  # releases not yet answered
        try:
            self._call(self.aio.start(), settings.connect_timeout_ms / 1000)
        except (Unavailable, TimeoutError, concurrent.futures.TimeoutError):
            self.enabled = False
            self.metrics.fallbacks.labels("directory_unavailable").inc()

    def _run_loop(self, place: Callable[[], None]) -> None:
        place()  # settings.thread_cpus
        self._loop.run_forever()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        future = self._submit(coro)
        try:
            return future.result(timeout_s + _GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()  # the coroutine's finally still fences its buffers on the loop
            raise

    def lookup(
        self,
        tokens: TokenIds,
        *,
        max_tokens: int | None = None,
        extras: ChunkExtras | None = None,
        trace_id: str | None = None,
    ) -> Hit:
        if not self.enabled:
            return self.aio._fallback(Hit(0, self.aio.spec.layout.tokens_per_chunk, (), ()), "closed")
        return self._call(
            self.aio.lookup(tokens, max_tokens=max_tokens, extras=extras, trace_id=trace_id),
            self.settings.lookup_timeout_ms / 1000,
        )

    def lookup_async(
        self,
        tokens: TokenIds,
        *,
        max_tokens: int | None = None,
        extras: ChunkExtras | None = None,
        trace_id: str | None = None,
    ) -> concurrent.futures.Future[Hit]:
        """`lookup` without waiting: a future that ends within `lookup_timeout_ms` (an empty hit
        with `cause` on failure). For schedulers that must not block on the cluster."""
        if not self.enabled:
            done: concurrent.futures.Future[Hit] = concurrent.futures.Future()
            done.set_result(
                self.aio._fallback(Hit(0, self.aio.spec.layout.tokens_per_chunk, (), ()), "closed")
            )
            return done
        return self._submit(self.aio.lookup(tokens, max_tokens=max_tokens, extras=extras, trace_id=trace_id))

    def load(
        self,
        hit: Hit,
        dests: Sequence[Sequence[Destination]],
        *,
        first_chunk: int = 0,
        dest_ids: Sequence[Sequence[DestId]] | None = None,
    ) -> LoadResult:
        """Blocks until the load ended; afterwards nothing writes into `dests` any more."""
        gate = WriteGate()  # the loan of `dests`: closed by the load, or here if the loop is late
        future = self._submit(
            self.aio.load(hit, dests, first_chunk=first_chunk, dest_ids=dest_ids, gate=gate)
        )
        try:
            return future.result(self.settings.load_timeout_ms / 1000 + _GRACE_S)
        except concurrent.futures.TimeoutError:
            # Take the buffers back from this thread first: a stalled loop could not run the
            # coroutine's finally in time, but worker threads would go on writing (the close
            # waits for at most one block in progress). Then cancel and let the finally clean up.
            gate.close()
            self._loop.call_soon_threadsafe(future.cancel)
            concurrent.futures.wait([future], timeout=_GRACE_S)
            self.metrics.fallbacks.labels("timeout").inc()
            return LoadResult(
                first_chunk * hit.tokens_per_chunk, 0, 0, tuple(range(first_chunk, hit.chunks)), "timeout"
            )

    def save_async(
        self,
        tokens: TokenIds,
        objects: Sequence[Sequence[Source]],
        *,
        first_chunk: int = 0,
        extras: ChunkExtras | None = None,
        trace_id: str | None = None,
    ) -> concurrent.futures.Future[SaveResult] | None:
        """Start a save and return at once (None when it was dropped: disabled or over limits)."""
        if not self.enabled:
            self.metrics.saves_dropped.labels("closed").inc()
            return None
        return self._submit(
            self.aio.save(tokens, objects, first_chunk=first_chunk, extras=extras, trace_id=trace_id)
        )

    def save(
        self, tokens: TokenIds, objects: Sequence[Sequence[Source]], *, first_chunk: int = 0
    ) -> SaveResult:
        """`save_async` and wait for the outcome (tests, benchmarks, offline warm-up)."""
        future = self.save_async(tokens, objects, first_chunk=first_chunk)
        if future is None:
            return SaveResult(chunks_failed=len(objects), causes={"closed": len(objects)})
        return future.result(self.settings.save_timeout_ms / 1000 * 3 + _GRACE_S)

    def release(self, hit: Hit) -> None:
        """Release the hit's lease without waiting (a lost release expires at the directory)."""
        if hit.lease_id and self.enabled:
            future = self._submit(self.aio.release(hit))
            self._releases.add(future)
            future.add_done_callback(self._releases.discard)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        concurrent.futures.wait(list(self._releases), timeout=self.settings.lookup_timeout_ms / 1000)
        try:
            self._call(self.aio.close(), self.settings.save_timeout_ms / 1000)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=_GRACE_S)
            self._loop.close()

    def __enter__(self) -> KvClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

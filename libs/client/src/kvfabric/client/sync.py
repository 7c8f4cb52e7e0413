"""The synchronous facade engines call from their worker threads.

`KvClient` owns an event loop on a daemon thread and runs an `AsyncKvClient` there. Every call
is bounded: lookups by `lookup_timeout_ms`, loads by `load_timeout_ms` (plus a grace for the
loop), so an engine thread never hangs on the cluster. `save_async` never blocks: it copies
nothing and hands the save to the loop (the caller gives up its buffers), where it is admitted
or dropped (its result says why). Its admission is taken first, in the caller's thread: with
`saves_queued_max` saves handed and not ended, or their sources' bytes past
`save_inflight_bytes_max` with this one, it drops the save at once (`queue_full`, `bytes`; one
save alone is handed, unless its rate was taken and it is past the bound by itself: the loop
would refuse it), so a loop that lags never holds more (`handed_refusal`). Around
`close`, `lookup` and `load` end in a miss ("closed"),
never an exception in the engine's thread; a `lookup_async` or `save_async` future that `close`
cancels reads cancelled (engines treat it as a miss / a dropped save).
If the client cannot start, it runs *disabled*: every lookup is a miss (cause "closed"), every
save is dropped, and the engine simply recomputes. Why is its `status` (and the fallback counted
once by cause, and logged in one line, no traceback): a setting it cannot use (`config_error`:
an unreadable password file, a bad URL), NATS refusing it (`auth_refused`: wrong credentials, a
tenant NATS does not know), or a cluster down (`nats_unreachable`) or not answering
(`nats_timeout`) at start. Starting takes at most `connect_timeout_ms` (`kvfabric.client.connect`);
with `background_start` the constructor returns at once and lookups miss (cause "starting")
until it is done (an engine's start-up then never waits for the cluster).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import ssl
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import msgspec.structs

from kvfabric.client.aio import AsyncKvClient, Destination, EngineSpec, Source
from kvfabric.client.aio_saves import QUEUE_FULL, SAVE_BYTES, SAVE_PHASES, aborts_bound_s
from kvfabric.client.hits import Hit, LoadResult, SaveResult
from kvfabric.client.metrics import ClientMetrics
from kvfabric.client.save_memory import SaveMemory
from kvfabric.client.settings import ClientSettings
from kvfabric.client.threads import thread_placement
from kvfabric.core.client_loads import DestId
from kvfabric.dataplane.scatter import WriteGate
from kvfabric.dataplane.tls import client_context
from kvfabric.format.errors import BadRequest, Indeterminate, KvfError, Unauthorized, Unavailable
from kvfabric.format.invariant import invariant
from kvfabric.format.key import ChunkExtras, TokenIds

__all__ = ["ClientStatus", "KvClient", "handed_refusal", "start_cause"]

log = logging.getLogger("kvfabric.client")

T = TypeVar("T")
_GRACE_S = 5.0  # beyond a call's own timeout: the loop thread is late only if the process is stuck
# `AsyncKvClient.close`'s steps beside its waits for saves and lookups: the report queue, the
# NATS drain, the executors' shutdown.
_CLOSE_STEPS_S = 15.0


async def _settle_tasks(timeout_s: float) -> None:
    """Cancel what still runs on the loop and let it end (what `asyncio.run` does before it closes
    a loop). A start cancelled by `close` is only *asked* to stop when its future reads cancelled:
    left pending, it was destroyed with the loop and finalized later, its errors landing in
    whatever ran then (an unraisable error failing a random later test)."""
    me = asyncio.current_task()
    rest = [task for task in asyncio.all_tasks() if task is not me]
    for task in rest:
        task.cancel()
    if rest:
        await asyncio.wait(rest, timeout=timeout_s)


# `status.state` values
STARTING: Final = "starting"
ENABLED: Final = "enabled"
DISABLED: Final = "disabled"
# Fallback causes of a client that could not start (`kvfabric_client_fallbacks_total`, once each)
CONFIG_ERROR: Final = "config_error"
AUTH_REFUSED: Final = "auth_refused"
NATS_UNREACHABLE: Final = "nats_unreachable"
NATS_TIMEOUT: Final = "nats_timeout"
CLIENT_ERROR: Final = "client_error"  # anything else: a bug, logged with its traceback
_OPERATOR_CAUSES: Final = (CONFIG_ERROR, AUTH_REFUSED)  # logged as errors: someone must act


@dataclass(frozen=True, slots=True)
class ClientStatus:
    """Whether the client serves (`state`: starting, enabled, disabled); when disabled, why:
    `cause` (a fallback cause) and `detail` (the one line logged)."""

    state: str
    cause: str = ""
    detail: str = ""


def start_cause(exc: BaseException) -> str:
    """The fallback cause of a start that raised `exc` (pure)."""
    if isinstance(exc, BadRequest):
        return CONFIG_ERROR
    if isinstance(exc, Unauthorized):
        return AUTH_REFUSED
    if isinstance(exc, Unavailable):
        return NATS_UNREACHABLE
    if isinstance(exc, Indeterminate | TimeoutError | concurrent.futures.TimeoutError):
        return NATS_TIMEOUT
    if isinstance(exc, OSError):  # the metrics port, say
        return CONFIG_ERROR
    return CLIENT_ERROR


def handed_refusal(
    saves: int, nbytes: int, size_bytes: int, settings: ClientSettings, *, rate_taken: bool = False
) -> str | None:
    """Why `save_async` drops a save of `size_bytes` source bytes in the caller's thread, with
    `saves` saves of `nbytes` handed to the loop and not ended there, or None to hand it (pure).
    The loop's own admission (`SaveMixin.save_admission`) bounds the saves *running*; this bounds
    what a loop that lags (stalled, busy, saves slow) has queued and not started, each save
    holding its sources: an engine thread calling on went on queueing them without bound.
    Sources are counted whole (the loop's save rate may keep a prefix of them, but they stay
    referenced until the save ends). One save alone is handed: its bytes are the caller's
    already, and the loop decides it as before (past the bytes bound unless the rate cuts it) —
    but not one past `save_inflight_bytes_max` whose rate the caller took (`rate_taken`): the
    rate keeps all of it, and the loop refuses any save past the bound (`save_admission`), alone
    or not, so it is refused here (`bytes`), before it is queued."""
    if saves >= settings.saves_queued_max:
        return QUEUE_FULL
    if saves and nbytes + size_bytes > settings.save_inflight_bytes_max:
        return SAVE_BYTES
    if rate_taken and size_bytes > settings.save_inflight_bytes_max:
        return SAVE_BYTES
    return None


def _source_bytes(objects: Sequence[Sequence[Source]]) -> int:
    """The bytes a save's sources hold (what handing it pins). A source that is no buffer, or a
    released memoryview (`ValueError`), counts nothing here: the loop's save refuses it as before
    (the caller's error in its future, never raised into the engine's thread)."""
    total = 0
    for row in objects:
        for source in row:
            try:
                total += memoryview(source).nbytes
            except (TypeError, ValueError):
                continue
    return total


def _unusable_tls(settings: ClientSettings) -> str | None:
    """Why `settings.data_tls_ca` cannot be used (None when unset or usable)."""
    if not settings.data_tls_ca:
        return None
    try:
        client_context(settings.data_tls_ca)
    except (OSError, ssl.SSLError) as exc:
        return f"data_tls_ca {settings.data_tls_ca!r}: {exc}"
    return None


class KvClient:
    """Thread-safe blocking client; one per engine process (or worker)."""

    def __init__(
        self,
        settings: ClientSettings,
        spec: EngineSpec,
        *,
        metrics: ClientMetrics | None = None,
        background_start: bool = False,
        failure_log_level: int | None = None,
    ) -> None:
        """Start the client: wait for it (at most `connect_timeout_ms`), or with
        `background_start` return at once. Never raises for a cache that cannot start: the
        client is disabled, its `status` says why, one line is logged at `failure_log_level`
        (default: ERROR for a setting or a refusal someone must fix, WARNING for a cluster
        that is down or silent)."""
        self._starting: concurrent.futures.Future[None] | None = None
        unusable = _unusable_tls(settings)
        if unusable is not None:
            # (the data plane's TLS context is built with the client: a CA file missing or not
            # PEM raised out of this constructor into vLLM's or SGLang's start; review, stop 68)
            self._setup(msgspec.structs.replace(settings, data_tls_ca=""), spec, metrics, failure_log_level)
            self._disable(CONFIG_ERROR, unusable)
            return
        self._setup(settings, spec, metrics, failure_log_level)
        starting = self._submit(self.aio.start())
        self._starting = starting
        if background_start:
            starting.add_done_callback(self._started)
            return
        done, _ = concurrent.futures.wait([starting], settings.connect_timeout_ms / 1000 + _GRACE_S)
        if not done:  # the loop thread is stuck: the start bounds itself by connect_timeout_ms
            self._closing = True  # no second line from the cancelled start
            self._loop.call_soon_threadsafe(starting.cancel)
            self._disable(NATS_TIMEOUT, f"start not done within {settings.connect_timeout_ms} ms")
            return
        self._started(starting)

    @classmethod
    def disabled(
        cls,
        spec: EngineSpec,
        cause: str,
        detail: str,
        *,
        settings: ClientSettings | None = None,
        failure_log_level: int | None = None,
    ) -> KvClient:
        """A client that never starts (e.g. an engine whose cache settings cannot be read):
        misses and dropped saves, `status` disabled with `cause`; `detail` is logged once."""
        client = cls.__new__(cls)
        client._setup(settings or ClientSettings(nats_url=""), spec, None, failure_log_level)
        client._starting = None
        client._disable(cause, detail)
        return client

    def _setup(
        self,
        settings: ClientSettings,
        spec: EngineSpec,
        metrics: ClientMetrics | None,
        failure_log_level: int | None,
    ) -> None:
        self.settings = settings
        self.aio = AsyncKvClient(settings, spec, metrics=metrics)
        self.metrics = self.aio.metrics
        self.status = ClientStatus(STARTING)
        # Saves are submitted to the loop, and `close` turns the client off, under this lock: a
        # save that passed the check while another thread closed raised RuntimeError (the loop
        # closed) or was queued on a stopped loop, its future never resolved (review, 2026-12-05).
        self._submit_lock = threading.Lock()
        # Saves handed to the loop and not ended there, and their sources' bytes (under
        # `_submit_lock`; `handed_refusal`): the loop admits at most `saves_queued_max` at once,
        # but a stalled or busy loop admitted nothing while an engine went on handing it saves,
        # each holding its sources (review, stop 68: by count; the bytes, 2026-12-07). Taken in
        # the engine's thread before the save is queued, given back once by `_save_ended` when
        # the save's future ends there (result, error, or cancelled by `close`).
        self._saves_submitted = 0
        self._bytes_submitted = 0
        self._failure_log_level = failure_log_level
        self._closing = False
        self._close_lock = threading.Lock()  # one `close` runs; another waits for it to end
        self._closed = False  # `close` ran (once): a loop thread it could not stop is left to die
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_loop,
            args=(thread_placement(settings.thread_cpus, background=False),),  # in the creating thread
            name="kvf-client-loop",
            daemon=True,
        )
        self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.status.state == ENABLED

    def _started(self, starting: concurrent.futures.Future[None]) -> None:
        """The start ended (on the loop thread with `background_start`)."""
        if self._closing or starting.cancelled():
            return  # closed before the start ended
        exc = starting.exception()
        if exc is None:
            with self._submit_lock:  # a `close` that began meanwhile wins (review, 2026-12-06: a
                # start ending as close began re-enabled the client over its closed loop)
                if not self._closed:
                    self.status = ClientStatus(ENABLED)
            return
        cause = start_cause(exc)
        detail = exc.message if isinstance(exc, KvfError) else f"{type(exc).__name__}: {exc}"
        self._disable(cause, detail, exc if cause == CLIENT_ERROR else None)

    def _disable(self, cause: str, detail: str, bug: BaseException | None = None) -> None:
        self.status = ClientStatus(DISABLED, cause, detail)
        self.metrics.fallbacks.labels(cause).inc()
        level = self._failure_log_level
        if level is None:
            level = logging.ERROR if cause in (*_OPERATOR_CAUSES, CLIENT_ERROR) else logging.WARNING
        log.log(
            level,
            "kvfabric client disabled (%s): %s; the engine runs without the KV cache (recomputes)",
            cause,
            detail,
            exc_info=bug,  # a traceback only for what no one expected
        )
        if self.settings.metrics_port >= 0 and self.aio.nc is None:  # the cause stays visible
            try:
                self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
                self.aio.serves_metrics = True  # stopped by `close`
            except OSError as exc:
                log.log(
                    level,
                    "kvfabric client: cannot serve metrics on port %d: %s",
                    self.settings.metrics_port,
                    exc,
                )

    def _run_loop(self, place: Callable[[], None]) -> None:
        place()  # settings.thread_cpus
        self._loop.run_forever()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _submit_lookup(self, coro: Coroutine[Any, Any, Hit]) -> concurrent.futures.Future[Hit]:
        """`_submit` for a lookup, whose hit holds read leases: a hit nobody can take any more
        (its future cancelled by `lookup`'s timeout or a `lookup_async` caller just as the
        lookup ended) is given back (`release_soon`). With `run_coroutine_threadsafe` the
        cancelled future dropped it and its leases stayed held until their TTL (stop 70's list).
        The hand-over is one atomic step of the future (`set_running_or_notify_cancel`): either
        the caller gets the hit or the client gives it back, never neither."""
        handed: concurrent.futures.Future[Hit] = concurrent.futures.Future()
        loop = self._loop

        def hand_over(task: asyncio.Task[Hit]) -> None:  # on the loop thread
            if task.cancelled():
                handed.cancel()
                return
            failure = task.exception()
            if not handed.set_running_or_notify_cancel():  # the caller gave up on it
                if failure is None:
                    self.aio.release_soon(task.result())
                return
            if failure is not None:
                handed.set_exception(failure)
            else:
                handed.set_result(task.result())

        def start() -> None:  # on the loop thread
            if handed.cancelled():
                coro.close()
                return
            task = loop.create_task(coro)
            task.add_done_callback(hand_over)

            def given_up(future: concurrent.futures.Future[Hit]) -> None:  # any thread
                if future.cancelled() and not task.done():
                    with contextlib.suppress(RuntimeError):  # the loop closed: its tasks ended
                        loop.call_soon_threadsafe(task.cancel)

            handed.add_done_callback(given_up)

        loop.call_soon_threadsafe(start)
        return handed

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
        # Checked and submitted under the lock `close` turns the client off under: a lookup
        # submitted after `close` settled the loop was never answered (review, 2026-12-06).
        with self._submit_lock:
            if not self.enabled:
                return self._off_hit()
            future = self._submit_lookup(
                self.aio.lookup(tokens, max_tokens=max_tokens, extras=extras, trace_id=trace_id)
            )
        try:
            return future.result(self.settings.lookup_timeout_ms / 1000 + _GRACE_S)
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
            # closed meanwhile (its lookups cancelled): a miss, never an error in the engine's
            # thread (review, 2026-12-06). Cancelled, what it was granted is given back when its
            # requests answer (`AsyncKvClient.lookup`), or when it ends with its hit
            # (`_submit_lookup`); one the cancel came too late for (being handed over, or
            # handed) is its hit (review, stop 65: dropped, its leases were held until `close`).
            if not future.cancel():
                with contextlib.suppress(Exception):
                    return future.result(_GRACE_S)  # set at once: the loop is handing it over
            if not self._closed:  # no answer in time (a stalled loop, slow shards): a miss too,
                # never an error in the engine's thread (it was raised; review, stop 67)
                empty = Hit(0, self.aio.spec.layout.tokens_per_chunk, (), ())
                return self.aio._fallback(empty, "directory_timeout")
            return self._off_hit()

    def lookup_async(
        self,
        tokens: TokenIds,
        *,
        max_tokens: int | None = None,
        extras: ChunkExtras | None = None,
        trace_id: str | None = None,
    ) -> concurrent.futures.Future[Hit]:
        """`lookup` without waiting: a future that ends within `lookup_timeout_ms` (an empty hit
        with `cause` on failure). For schedulers that must not block on the cluster. Cancelled
        (`future.cancel()` True), its hit, if it still comes, is given back by the client."""
        with self._submit_lock:  # as `lookup`: nothing submitted once `close` settles the loop
            if not self.enabled:
                done: concurrent.futures.Future[Hit] = concurrent.futures.Future()
                done.set_result(self._off_hit())
                return done
            return self._submit_lookup(
                self.aio.lookup(tokens, max_tokens=max_tokens, extras=extras, trace_id=trace_id)
            )

    def load(
        self,
        hit: Hit,
        dests: Sequence[Sequence[Destination]],
        *,
        first_chunk: int = 0,
        dest_ids: Sequence[Sequence[DestId]] | None = None,
    ) -> LoadResult:
        """Blocks until the load ended; afterwards nothing writes into `dests` any more. A small
        load (at most 16 MiB, one segment: `LOAD_NOW_BYTES_MAX`), or a co-located one of any
        size up to `LOAD_NOW_LOCAL_BYTES_MAX` (1 GiB) in one mapped arena, is read right here, on
        the calling thread (`AsyncKvClient.load_now`: no hop to the client's loop, a worker and
        back)."""
        if self._closed:  # its loop is closed or closing: nothing loads (it raised RuntimeError)
            return self._unloaded(hit, first_chunk, "closed")
        if self.enabled:  # every write into `dests` ends in the call: no fence to keep (dest_ids)
            done = self.aio.load_now(hit, dests, first_chunk=first_chunk)
            if done is not None:
                return done
        gate = WriteGate()  # the loan of `dests`: closed by the load, or here if the loop is late
        with self._submit_lock:  # as `lookup`: nothing submitted once `close` settles the loop
            if self._closed:
                return self._unloaded(hit, first_chunk, "closed")
            future = self._submit(
                self.aio.load(hit, dests, first_chunk=first_chunk, dest_ids=dest_ids, gate=gate)
            )
        try:
            return future.result(self.settings.load_timeout_ms / 1000 + _GRACE_S)
        except concurrent.futures.CancelledError:
            # `close` cancelled it (review, 2026-12-06: raised into the engine's thread). Its
            # finally fenced the buffers on the loop; closing the gate here makes sure of it.
            gate.close()
            return self._unloaded(hit, first_chunk, "closed")
        except concurrent.futures.TimeoutError:
            # Take the buffers back from this thread first: a stalled loop could not run the
            # coroutine's finally in time, but worker threads would go on writing (the close
            # waits for at most one block in progress). Then cancel and let the finally clean up.
            gate.close()
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(future.cancel)
            concurrent.futures.wait([future], timeout=_GRACE_S)
            return self._unloaded(hit, first_chunk, "closed" if self._closed else "timeout")

    def _unloaded(self, hit: Hit, first_chunk: int, cause: str) -> LoadResult:
        """A load that wrote nothing the engine may use: every asked chunk is recomputed."""
        self.metrics.fallbacks.labels(cause).inc()
        failed = tuple(range(first_chunk, hit.chunks))
        return LoadResult(first_chunk * hit.tokens_per_chunk, 0, 0, failed, cause)

    def save_async(
        self,
        tokens: TokenIds,
        objects: Sequence[Sequence[Source]],
        *,
        first_chunk: int = 0,
        extras: ChunkExtras | None = None,
        trace_id: str | None = None,
        rate_taken: bool = False,
    ) -> concurrent.futures.Future[SaveResult] | None:
        """Start a save and return at once (None when the client is off; a save over the
        client's limits is dropped, here or on the loop: its result's causes say so, and
        `saves_dropped` counts it). Here, in the caller's thread and before anything is queued:
        with `saves_queued_max` saves handed and not ended, or their sources' bytes with this
        one's past `save_inflight_bytes_max` (or, `rate_taken`, this one's alone), the future
        is done at once (`queue_full`, `bytes`: `handed_refusal`), and the caller has its
        buffers back on return.
        `rate_taken`: the caller took the save rate for these chunks (`take_save_rate`)."""
        size = _source_bytes(objects)
        with self._submit_lock:
            if not self.enabled:
                self.metrics.saves_dropped.labels(self.off_cause()).inc()
                return None
            refused = handed_refusal(
                self._saves_submitted, self._bytes_submitted, size, self.settings, rate_taken=rate_taken
            )
            if refused is not None:
                self.metrics.saves_dropped.labels(refused).inc()
                dropped: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
                dropped.set_result(SaveResult(chunks_failed=len(objects), causes={refused: len(objects)}))
                return dropped
            saving = self._submit(
                self.aio.save(
                    tokens,
                    objects,
                    first_chunk=first_chunk,
                    extras=extras,
                    trace_id=trace_id,
                    rate_taken=rate_taken,
                )
            )
            self._saves_submitted += 1
            self._bytes_submitted += size
        # Run once where the save's future ends (here, at once, if it has ended already), and
        # before the caller's future ends (`_ends_with`'s callback, added after it): a caller
        # that starts its next save when one ends (a chained save) finds its room given back.
        saving.add_done_callback(functools.partial(self._save_ended, size))
        return _ends_with(saving)

    def _save_ended(self, size: int, _done: concurrent.futures.Future[SaveResult]) -> None:
        with self._submit_lock:
            self._saves_submitted -= 1
            self._bytes_submitted -= size
            invariant(
                self._saves_submitted >= 0 and self._bytes_submitted >= 0,
                "a handed save given back twice",
                saves=self._saves_submitted,
                nbytes=self._bytes_submitted,
            )

    def save_async_refusal(self, nbytes: int, *, rate_taken: bool = False) -> str | None:
        """Why `save_async(..., rate_taken=rate_taken)` would refuse, in the caller's thread, a
        save of `nbytes` source bytes if called now (the client off: `off_cause()`; else
        `handed_refusal`: `queue_full`, `bytes` — with `rate_taken`, also for a save alone past
        `save_inflight_bytes_max`, which the loop would refuse), or None. Takes and counts
        nothing, and binds nothing: saves ending or handed meanwhile change the answer, and
        `save_async` decides again (it, or the loop, may still refuse). Ask before copying KV out
        for a save, so a save it would refuse is not copied at all."""
        with self._submit_lock:
            if not self.enabled:
                return self.off_cause()
            return handed_refusal(
                self._saves_submitted, self._bytes_submitted, nbytes, self.settings, rate_taken=rate_taken
            )

    def peek_save_rate(self, chunk_sizes: Sequence[int]) -> int:
        """How many leading chunks of these sizes `take_save_rate` would cover now, taking
        nothing (all of them with no rate or the client off): an engine asks what it may save
        before it asks `save_async_refusal` about those chunks' bytes. Advisory: another save
        may take the rate in between."""
        if not self.enabled:
            return len(chunk_sizes)
        return self.aio.peek_save_rate(chunk_sizes)

    def take_save_rate(self, chunk_sizes: Sequence[int]) -> int:
        """Take the engine's save rate (`ClientSettings.save_bytes_per_s_max`) for the leading
        chunks of these sizes it covers now and say how many: all of them when it has no rate or
        the client is off (`save_async` then counts why). Ask before copying KV out for a save,
        so chunks the rate would skip are not copied; then save the chunks it covered with
        `save_async(..., rate_taken=True)`. Each call takes: saves asked together share it."""
        if not self.enabled:
            return len(chunk_sizes)
        return self.aio.take_save_rate(chunk_sizes)

    def save(
        self, tokens: TokenIds, objects: Sequence[Sequence[Source]], *, first_chunk: int = 0
    ) -> SaveResult:
        """`save_async` and wait for the outcome (tests, benchmarks, offline warm-up)."""
        future = self.save_async(tokens, objects, first_chunk=first_chunk)
        if future is None:
            return SaveResult(chunks_failed=len(objects), causes={"closed": len(objects)})
        return future.result(self.settings.save_timeout_ms / 1000 * 3 + _GRACE_S)

    def save_memory(self, nbytes: int) -> SaveMemory:
        """Memory for the engine to gather KV into before it saves it (`AsyncKvClient.save_memory`)."""
        return self.aio.save_memory(nbytes)

    def release(self, hit: Hit) -> None:
        """Release the hit's lease without waiting: gathered with other hits' on the loop
        (`AsyncKvClient.release_soon`); `close` gives back whatever is still held."""
        if hit.shard_leases and self.enabled:
            with contextlib.suppress(RuntimeError):  # the loop closed: close gave every lease back
                self._loop.call_soon_threadsafe(self.aio.release_soon, hit)

    def off_cause(self) -> str:
        """Why a call is answered as if the client were off: `starting`, or `closed`."""
        return STARTING if self.status.state == STARTING else "closed"

    def _off_hit(self) -> Hit:
        return self.aio._fallback(Hit(0, self.aio.spec.layout.tokens_per_chunk, (), ()), self.off_cause())

    def close(self) -> None:
        """Give back what the client holds and stop its loop; bounded, never raises. No save is
        handed from its start on (`save_async` None, `save` `closed`); a save still running
        past its deadlines writes nothing more (`AsyncKvClient.close`). A second
        close, from any thread, waits for the first to end (two threads closing at once both ran
        the steps, and one's settling cancelled the other's close: CancelledError in its thread;
        review, stop 68)."""
        with self._close_lock:
            self._close()

    def _close(self) -> None:
        if self._closed or self._loop.is_closed():
            return
        self._closed = True
        # From now on lookups miss and saves are dropped (`closed`): the engine's calls after
        # `close` went to a closed loop and raised RuntimeError (review, 2026-12-05).
        with self._submit_lock:  # no save submitted from now on (`save_async`)
            if self.status.state != DISABLED:  # (a disabled one keeps its cause)
                self.status = ClientStatus(DISABLED, "closed", "closed")
        if self._starting is not None and not self._starting.done():  # a background start
            self._closing = True
            self._loop.call_soon_threadsafe(self._starting.cancel)
            concurrent.futures.wait([self._starting], timeout=_GRACE_S)
            self.status = ClientStatus(DISABLED, "closed", "closed before it started")
        try:
            # Its own steps are bounded (leases given back, saves and their aborts waited for,
            # the NATS drain): what they may take in all. Past it the close goes on here without
            # raising into the engine's shutdown (it raised TimeoutError; review, 2026-12-05).
            # Saves: `SAVE_PHASES` × `save_timeout_ms` (`AsyncKvClient.close`), then the aborts
            # of cancelled ones, `ABORT_PHASES` × `save_timeout_ms` and a grace (`aborts_bound_s`;
            # one `save_timeout_ms` before, short of a late begin answer's aborts).
            s = self.settings
            saves_s = SAVE_PHASES * s.save_timeout_ms / 1000 + aborts_bound_s(s.save_timeout_ms)
            bound_s = saves_s + 3 * s.lookup_timeout_ms / 1000 + _CLOSE_STEPS_S
            self._call(self.aio.close(), bound_s)
        except concurrent.futures.TimeoutError:
            log.warning("kvfabric: the client's close overran %.0f s: closing what is left", bound_s)
        finally:
            settling = asyncio.run_coroutine_threadsafe(_settle_tasks(_GRACE_S), self._loop)
            with contextlib.suppress(Exception):  # a stuck loop thread: close it as it is
                settling.result(_GRACE_S + 1.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=_GRACE_S)
            if self._thread.is_alive():  # wedged in a call: closing a running loop raises
                log.warning("kvfabric: the client's loop thread did not stop; left to exit with the process")
            else:
                self._loop.close()

    def __enter__(self) -> KvClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _ends_with(inner: concurrent.futures.Future[T]) -> concurrent.futures.Future[T]:
    """A future that ends when `inner`'s coroutine has ended on the loop, and that its holder
    cannot cancel (`cancel()` is False): `inner`, cancelled from the engine's thread, ended at
    once, and a save's sources (save slots given back on its end) were reused while its writes
    still read them (review, stop 66). A save ends by its own deadline; `close` waits for it."""
    outer: concurrent.futures.Future[T] = concurrent.futures.Future()
    outer.set_running_or_notify_cancel()

    def settle(done: concurrent.futures.Future[T]) -> None:
        if done.cancelled():  # (the loop cancelled it: the client closing)
            outer.set_exception(concurrent.futures.CancelledError())
        elif (exc := done.exception()) is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(done.result())

    inner.add_done_callback(settle)
    return outer

"""`KvClient.save_async` bounds the saves handed to its loop and not yet ended there by
`saves_queued_max` (review, stop 68): the loop admits at most that many at once, but while it was
stalled or busy an engine thread went on handing it saves, each holding its sources, without
bound. Over the bound a save is dropped in the engine's thread (`queue_full`), as the loop drops
one, and the count goes down as the handed saves end. Their sources' bytes are bounded there too,
by `save_inflight_bytes_max` (`bytes`; 2026-12-07)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from kvfabric.client.hits import SaveResult
from kvfabric.client.settings import ClientSettings
from kvfabric.client.sync import ENABLED, ClientStatus, KvClient, _source_bytes
from kvfabric.testing.clientkit import CHUNK_BYTES, SPEC, TOKENS_PER_CHUNK, objects_for, prompt

QUEUED_MAX = 3


def test_saves_handed_to_a_stalled_loop_are_bounded() -> None:
    settings = ClientSettings(nats_url="nats://unused:1", saves_queued_max=QUEUED_MAX, save_timeout_ms=200)
    kv = KvClient.disabled(SPEC, "config_error", "test", settings=settings)
    kv.status = ClientStatus(ENABLED)  # as if started: saves are handed to the loop
    unstall = threading.Event()
    kv._loop.call_soon_threadsafe(unstall.wait, 30)  # the loop is busy in a call
    tokens = prompt(TOKENS_PER_CHUNK)
    try:
        handed = [kv.save_async(tokens, objects_for(tokens, 0, 1)) for _ in range(QUEUED_MAX)]
        assert all(f is not None and not f.done() for f in handed)  # queued on the loop
        dropped = kv.save_async(tokens, objects_for(tokens, 0, 1))
        assert dropped is not None and dropped.done()  # dropped at once, in this thread
        assert dropped.result(0).causes == {"queue_full": 1} and dropped.result(0).chunks_failed == 1
        assert kv.metrics.saves_dropped.labels("queue_full")._value.get() == 1
        unstall.set()
        for future in handed:
            assert future is not None
            future.exception(10)  # each ends on the loop (how does not matter here)
        again = kv.save_async(tokens, objects_for(tokens, 0, 1))
        assert again is not None
        again.exception(10)
        assert kv.metrics.saves_dropped.labels("queue_full")._value.get() == 1  # handed, not dropped
    finally:
        unstall.set()
        kv.close()


def _enabled(*, bytes_max: int, queued_max: int) -> KvClient:
    settings = ClientSettings(
        nats_url="nats://unused:1",
        save_timeout_ms=200,
        save_inflight_bytes_max=bytes_max,
        saves_queued_max=queued_max,
    )
    kv = KvClient.disabled(SPEC, "config_error", "test", settings=settings)
    kv.status = ClientStatus(ENABLED)  # as if started: saves are handed to the loop
    return kv


def test_bytes_handed_to_a_stalled_loop_are_bounded_in_the_callers_thread() -> None:
    """The loop bounds the bytes of the saves it *runs* (`save_inflight_bytes_max`), but only the
    count of those handed to it was bounded in the engine's thread: a stalled loop held up to
    `saves_queued_max` saves of any size (64 × a prompt's KV) however small the bytes bound.
    Now the sources' bytes are taken before the save is queued; past the bound the save is
    dropped at once (`bytes`, counted) and the caller has its buffers back."""
    kv = _enabled(bytes_max=3 * CHUNK_BYTES, queued_max=64)
    unstall = threading.Event()
    kv._loop.call_soon_threadsafe(unstall.wait, 30)  # the loop is busy in a call
    tokens = prompt(TOKENS_PER_CHUNK)
    try:
        futures = [kv.save_async(tokens, objects_for(tokens, 0, 1)) for _ in range(20)]
        handed = [f for f in futures if f is not None and not f.done()]
        dropped = [f for f in futures if f is not None and f.done()]
        assert len(handed) == 3 and len(dropped) == 17  # queued: 20 before
        assert all(f.result(0).causes == {"bytes": 1} for f in dropped)
        assert kv.metrics.saves_dropped.labels("bytes")._value.get() == 17
        assert (kv._saves_submitted, kv._bytes_submitted) == (3, 3 * CHUNK_BYTES)
        unstall.set()
        for future in handed:
            future.exception(10)  # each ends on the loop (how does not matter here)
        assert (kv._saves_submitted, kv._bytes_submitted) == (0, 0)  # given back, once each
        # One save alone is handed whatever its size: the loop's admission decides it, as before.
        big = prompt(4 * TOKENS_PER_CHUNK)
        alone = kv.save_async(big, objects_for(big, 0, 4))
        assert alone is not None and alone.result(10).causes == {"bytes": 4}
        assert kv.metrics.saves_dropped.labels("bytes")._value.get() == 18  # (by the loop)
    finally:
        unstall.set()
        kv.close()


def test_saves_handed_by_many_threads_to_stalled_saves_never_pass_the_bounds() -> None:
    """Engine threads calling `save_async` at once while every save on the loop is stuck: at no
    time are more handed than the bounds allow (here the bytes: 5 one-chunk saves); each
    refused one is done in its caller's thread and counted; once the saves end, every one
    handed was given back exactly once (completion, failure and `close`'s cancel alike)."""
    kv = _enabled(bytes_max=5 * CHUNK_BYTES, queued_max=8)
    stuck = asyncio.Event()  # (bound to the client's loop on first wait)
    started: list[int] = []

    async def stuck_save(tokens: list[int], objects: object, **_: object) -> SaveResult:
        started.append(1)
        await stuck.wait()
        if len(started) % 2:  # half of them fail on the loop (a bug, say): given back too
            raise RuntimeError("save failed")
        return SaveResult(chunks_saved=1)

    kv.aio.save = stuck_save  # type: ignore[method-assign,assignment]
    tokens = prompt(TOKENS_PER_CHUNK)
    futures: list[concurrent.futures.Future[SaveResult]] = []
    most = [0]
    lock = threading.Lock()

    def engine() -> None:
        for _ in range(50):
            future = kv.save_async(tokens, objects_for(tokens, 0, 1))
            assert future is not None
            with lock:
                futures.append(future)
                most[0] = max(most[0], kv._saves_submitted)

    try:
        threads = [threading.Thread(target=engine) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        pending = [f for f in futures if not f.done()]
        assert len(futures) == 200 and len(pending) == 5 and most[0] <= 5
        refused = [f for f in futures if f.done()]
        assert all(f.result(0).causes == {"bytes": 1} for f in refused)
        assert kv.metrics.saves_dropped.labels("bytes")._value.get() == 195
        kv._loop.call_soon_threadsafe(stuck.set)
        concurrent.futures.wait(pending, 10)
        assert (kv._saves_submitted, kv._bytes_submitted) == (0, 0)
        stuck.clear()  # (on no waiter: safe from this thread)
        again = [kv.save_async(tokens, objects_for(tokens, 0, 1)) for _ in range(3)]
        assert all(f is not None and not f.done() for f in again)  # handed again
    finally:
        kv.close()  # cancels the three stuck saves: given back too
    assert (kv._saves_submitted, kv._bytes_submitted) == (0, 0)
    assert all(f is not None and isinstance(f.exception(0), concurrent.futures.CancelledError) for f in again)


def test_a_released_buffer_never_raises_in_the_callers_thread() -> None:
    """`memoryview()` of a released memoryview raises ValueError: counted as no bytes here, the
    save's own refusal left to its future (review: it escaped `save_async` into the engine)."""
    released = memoryview(bytearray(8))
    released.release()
    assert _source_bytes([[released, b"abcd"]]) == 4


def test_the_refusal_check_answers_as_save_async_would_and_takes_nothing() -> None:
    """`save_async_refusal(nbytes)`: the cause `save_async` would drop a save of `nbytes` with in
    the caller's thread now (`bytes`, `queue_full`; the off cause when the client is off), or
    None; it takes no room and counts nothing, so an engine asks it before copying KV out."""
    kv = _enabled(bytes_max=3 * CHUNK_BYTES, queued_max=2)
    unstall = threading.Event()
    kv._loop.call_soon_threadsafe(unstall.wait, 30)  # the loop is busy in a call
    tokens = prompt(TOKENS_PER_CHUNK)
    try:
        assert kv.save_async_refusal(10 * CHUNK_BYTES) is None  # one save alone is handed (no rate taken)
        first = kv.save_async(tokens, objects_for(tokens, 0, 1))
        assert first is not None and not first.done()
        assert kv.save_async_refusal(2 * CHUNK_BYTES) is None
        assert kv.save_async_refusal(3 * CHUNK_BYTES) == "bytes"
        assert (kv._saves_submitted, kv._bytes_submitted) == (1, CHUNK_BYTES)  # nothing taken
        assert kv.metrics.saves_dropped.labels("bytes")._value.get() == 0  # nothing counted
        refused = kv.save_async(prompt(3 * TOKENS_PER_CHUNK), objects_for(prompt(3 * TOKENS_PER_CHUNK), 0, 3))
        assert refused is not None and refused.result(0).causes == {"bytes": 3}  # as answered
        second = kv.save_async(tokens, objects_for(tokens, 0, 1))
        assert second is not None and not second.done()
        assert kv.save_async_refusal(1) == "queue_full"
        unstall.set()
        for future in (first, second):
            future.exception(10)
        assert kv.save_async_refusal(3 * CHUNK_BYTES) is None  # the room came back
    finally:
        unstall.set()
        kv.close()
    assert kv.save_async_refusal(1) == "closed"


def test_a_save_alone_past_the_bound_with_its_rate_taken_is_refused_in_the_callers_thread() -> None:
    """The loop refuses any save past `save_inflight_bytes_max`, alone or not (`save_admission`):
    one whose rate the caller took (`rate_taken`: the rate keeps all of it) can never start, yet
    a save alone was always handed, and `save_async_refusal` answered None for it, so the vLLM
    connector copied a long prefill out whole (1 GiB against 512 MiB) and the loop refused it,
    every time. Now both answer `bytes` for it in the caller's thread; without the rate taken the
    loop's rate may still cut it to a prefix that fits, so it is handed as before."""
    kv = _enabled(bytes_max=3 * CHUNK_BYTES, queued_max=8)
    unstall = threading.Event()
    kv._loop.call_soon_threadsafe(unstall.wait, 30)  # the loop is busy in a call: nothing runs there
    big = prompt(4 * TOKENS_PER_CHUNK)
    try:
        assert kv.save_async_refusal(4 * CHUNK_BYTES, rate_taken=True) == "bytes"
        assert kv.save_async_refusal(3 * CHUNK_BYTES, rate_taken=True) is None  # at the bound: fits
        assert kv.save_async_refusal(4 * CHUNK_BYTES) is None  # the rate not taken: handed
        refused = kv.save_async(big, objects_for(big, 0, 4), rate_taken=True)
        assert refused is not None and refused.done()  # in this thread: the loop is stalled
        assert refused.result(0).causes == {"bytes": 4} and refused.result(0).chunks_failed == 4
        assert kv.metrics.saves_dropped.labels("bytes")._value.get() == 1
        assert (kv._saves_submitted, kv._bytes_submitted) == (0, 0)  # nothing handed
        fits = kv.save_async(big, objects_for(big, 0, 3), rate_taken=True)
        assert fits is not None and not fits.done()  # handed to the (stalled) loop
        assert (kv._saves_submitted, kv._bytes_submitted) == (1, 3 * CHUNK_BYTES)
    finally:
        unstall.set()
        kv.close()

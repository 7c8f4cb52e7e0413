"""An engine's `KvClient.load` / `lookup` around `close` end in a miss, never an exception in the
engine's thread (review, 2026-12-06): a load after `close` raised RuntimeError (the loop was
closed: the fix of 2026-12-05 covered lookup and save only), and a load or lookup still running
when `close` ended raised `concurrent.futures.CancelledError` (close cancels what still runs)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
from typing import Any, cast

import pytest

from kvfabric.client import ClientSettings, KvClient, sync
from kvfabric.client.hits import Hit, LoadResult
from kvfabric.client.sync import ClientStatus
from kvfabric.proto import directory as m
from kvfabric.testing.ports import free_port
from tests.integration.clientkit import SPEC

TPC = SPEC.layout.tokens_per_chunk


def _client() -> KvClient:
    return KvClient.disabled(SPEC, "config_error", "test", settings=ClientSettings(nats_url="nats://x:1"))


def _hit() -> Hit:
    loc = m.ObjectLocation(
        chunk_index=0, member=m.Member(*SPEC.layout.member), size_bytes=8, checksum=b"c", replicas=[]
    )
    return Hit(TPC, TPC, (), (SPEC.layout.member,), ((loc,),))


def test_a_load_after_close_is_a_miss() -> None:
    kv = _client()
    kv.close()
    result = kv.load(_hit(), [[bytearray(8)]])
    assert result == LoadResult(0, 0, 0, (0,), "closed")


def test_a_load_or_lookup_running_when_close_ends_is_a_miss() -> None:
    kv = _client()
    kv.status = ClientStatus("enabled")  # as if started: calls go to the loop

    async def slow(*args: object, **kwargs: object) -> object:
        await asyncio.sleep(30)  # waits for transfers / the directory until close cancels it
        raise AssertionError("not cancelled")

    kv.aio.load = slow  # type: ignore[method-assign,assignment]
    kv.aio.lookup = slow  # type: ignore[method-assign,assignment]
    kv.aio.load_now = lambda *a, **k: None  # type: ignore[method-assign]
    kv.aio.close = lambda: asyncio.sleep(0)  # type: ignore[method-assign]
    results: list[object] = []
    threads = [
        threading.Thread(target=lambda: results.append(_call(lambda: kv.load(_hit(), [[bytearray(8)]])))),
        threading.Thread(target=lambda: results.append(_call(lambda: kv.lookup(list(range(2 * TPC)))))),
    ]
    for t in threads:
        t.start()
    time.sleep(0.3)
    kv.close()
    for t in threads:
        t.join(10)
    assert len(results) == 2, results
    load = next(r for r in results if not isinstance(r, Hit))
    lookup = next(r for r in results if isinstance(r, Hit))
    assert load == LoadResult(0, 0, 0, (0,), "closed"), load
    assert lookup.tokens == 0 and lookup.cause == "closed"


def _call(f: object) -> object:
    try:
        return f()  # type: ignore[operator]
    except BaseException as exc:  # what would have reached the engine's thread
        return exc


def test_a_start_that_ends_as_close_begins_leaves_the_client_closed() -> None:
    """The start's future was done before `close` looked, its callback not yet run: the callback
    then enabled the client over a closed loop (lookups and saves raised RuntimeError)."""
    kv = _client()
    started: concurrent.futures.Future[None] = concurrent.futures.Future()
    started.set_result(None)
    kv.close()
    kv._started(started)  # the callback, late
    assert not kv.enabled and kv.lookup(list(range(2 * TPC))).cause == "closed"


def test_a_close_past_its_bound_still_closes_the_pool_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """`KvClient.close` cancels the async close past its bound (a NATS drain that hangs): the
    pool (idle connections, watchdog, save memory) and the executors were never closed."""
    monkeypatch.setattr(sync, "_GRACE_S", 0.2)
    monkeypatch.setattr(sync, "_CLOSE_STEPS_S", 0.1)
    settings = ClientSettings(nats_url="nats://unused:1", save_timeout_ms=100, lookup_timeout_ms=100)
    kv = KvClient.disabled(SPEC, "test", "unit", settings=settings)
    kv.status = ClientStatus("enabled")

    class HangingDrain:
        is_closed = False
        is_draining = False

        async def drain(self) -> None:
            await asyncio.sleep(30)

    kv.aio.nc = cast(Any, HangingDrain())
    kv.aio._executor.submit(lambda: None)  # a transfer thread exists
    kv.close()
    assert kv.aio.pool._closed and kv.aio._executor._shutdown and kv.aio._save_executor._shutdown


def test_a_closed_clients_metrics_port_is_free_for_the_next_client() -> None:
    port = free_port()
    settings = ClientSettings(nats_url="nats://x:1", metrics_port=port)
    for _ in range(2):  # the second could not serve: the first's server held the port
        kv = KvClient.disabled(SPEC, "config_error", "test", settings=settings)
        assert kv.aio.serves_metrics
        kv.close()
    with socket.socket() as sock:
        sock.bind(("", port))  # nothing holds it now


def test_a_lookup_left_unanswered_by_a_closing_client_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup submitted as `close` settled the loop was never answered: it timed out and
    raised TimeoutError into the engine's thread."""
    monkeypatch.setattr(sync, "_GRACE_S", 0.05)
    kv = KvClient.disabled(
        SPEC, "config_error", "test", settings=ClientSettings(nats_url="nats://x:1", lookup_timeout_ms=100)
    )
    kv.status = ClientStatus("enabled")

    async def unanswered(*args: object, **kwargs: object) -> object:
        kv._closed = True  # close began meanwhile (its loop will never answer this one)
        await asyncio.sleep(30)
        raise AssertionError("not cancelled")

    kv.aio.lookup = unanswered  # type: ignore[method-assign,assignment]
    hit = kv.lookup(list(range(2 * TPC)))
    assert hit.tokens == 0
    kv._closed = False
    kv.close()


def test_a_lookup_without_an_answer_in_time_is_a_miss_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync lookup whose answer did not come within `lookup_timeout_ms` (+ the grace) on an
    open client (a stalled loop, shards answering slowly one after another) raised TimeoutError
    into the engine's thread, against "never raises for a cluster failure" (review, stop 67):
    now a miss counted `directory_timeout`."""
    monkeypatch.setattr(sync, "_GRACE_S", 0.05)
    kv = KvClient.disabled(
        SPEC, "config_error", "test", settings=ClientSettings(nats_url="nats://x:1", lookup_timeout_ms=100)
    )
    kv.status = ClientStatus("enabled")

    async def slow(*args: object, **kwargs: object) -> object:
        await asyncio.sleep(30)
        raise AssertionError("not cancelled")

    kv.aio.lookup = slow  # type: ignore[method-assign,assignment]
    hit = kv.lookup(list(range(2 * TPC)))
    assert hit.tokens == 0 and hit.cause == "directory_timeout"
    kv.close()


def test_a_second_close_waits_for_the_first_and_neither_raises() -> None:
    """Two threads closing at once (review, stop 68): the second returned before the client was
    closed, or, both past the check, ran the steps twice and one's settling cancelled the
    other's close (CancelledError in its thread). Now the second waits for the first."""
    kv = _client()
    kv.status = ClientStatus("enabled")
    closing = threading.Event()

    async def slow_close() -> None:
        closing.set()
        await asyncio.sleep(0.3)  # giving back leases, waiting for saves

    kv.aio.close = slow_close  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def close() -> None:
        try:
            kv.close()
        except BaseException as exc:  # what the engine's thread would see
            errors.append(exc)

    first = threading.Thread(target=close)
    first.start()
    assert closing.wait(5)
    kv.close()  # the second, in this thread
    assert kv._loop.is_closed()  # it returned only once the first had closed the client
    first.join(5)
    assert errors == []

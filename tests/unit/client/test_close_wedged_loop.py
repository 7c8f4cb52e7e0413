"""`KvClient.close` never raises into the engine's shutdown, even when the client's loop thread
is wedged in a call (review, 2026-12-06): the thread outlived its join, and closing its still
running loop raised `RuntimeError('Cannot close a running event loop')`; a second close repeated
every wait. Now the wedged thread is left to exit with the process, and close runs once."""

from __future__ import annotations

import threading
import time

import pytest

from kvfabric.client import sync
from kvfabric.client.settings import ClientSettings
from kvfabric.client.sync import KvClient
from kvfabric.testing.clientkit import SPEC


def test_close_with_a_wedged_loop_thread_returns_and_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync, "_GRACE_S", 0.2)
    monkeypatch.setattr(sync, "_CLOSE_STEPS_S", 0.2)
    settings = ClientSettings(nats_url="nats://unused:1", save_timeout_ms=100, lookup_timeout_ms=100)
    kv = KvClient.disabled(SPEC, "config_error", "test", settings=settings)
    unwedge = threading.Event()
    kv._loop.call_soon_threadsafe(unwedge.wait, 30)  # the loop thread blocks in a call
    try:
        started = time.monotonic()
        kv.close()  # raised RuntimeError before
        assert time.monotonic() - started < 10
        again = time.monotonic()
        kv.close()
        assert time.monotonic() - again < 0.1
    finally:
        unwedge.set()
        kv._thread.join(5)

"""A lookup its caller gave up on just as it ended (stop 70's list): the sync facade's future was
cancelled (`lookup`'s timeout, a `lookup_async` caller) after the lookup had its hit but before
the hit was handed over. `run_coroutine_threadsafe` then dropped the hit and its read leases stayed
held until their TTL; `KvClient._submit_lookup` gives them back."""

from __future__ import annotations

import threading
import time

import pytest

from kvfabric.client import ClientSettings, Hit, KvClient
from kvfabric.client.sync import ENABLED, ClientStatus
from tests.integration.clientkit import SPEC
from tests.unit.client.test_release_gather import hit_with, holding
from tests.unit.client.test_releases import ReleaseRouter


def _client_whose_lookup_blocks(
    monkeypatch: pytest.MonkeyPatch, lease: tuple[int, int]
) -> tuple[KvClient, ReleaseRouter, threading.Event, threading.Event]:
    kv = KvClient.disabled(
        SPEC,
        "test",
        "unit",
        settings=ClientSettings(nats_url="nats://unused:1"),
    )
    router = ReleaseRouter()
    holding(kv.aio, router, [])
    router.held.add(lease)  # the directory grants it with the lookup's answer
    kv.status = ClientStatus(ENABLED)
    inside, finish = threading.Event(), threading.Event()

    async def lookup(*_: object, **__: object) -> Hit:
        inside.set()
        finish.wait(10)  # blocks the loop: the cancel below cannot reach this task before it ends
        kv.aio._leases[lease] = 30_000  # granted, as `_lookup` records them
        return hit_with([lease])

    monkeypatch.setattr(kv.aio, "lookup", lookup)
    return kv, router, inside, finish


def test_a_lookup_async_cancelled_as_it_ends_gives_its_hit_back(monkeypatch: pytest.MonkeyPatch) -> None:
    lease = (0, 41)
    kv, router, inside, finish = _client_whose_lookup_blocks(monkeypatch, lease)
    try:
        future = kv.lookup_async([1, 2, 3])
        assert inside.wait(10)
        assert future.cancel()  # the caller gives up while the lookup is ending
        finish.set()
        deadline = time.monotonic() + 5
        while router.held and time.monotonic() < deadline:
            time.sleep(0.005)
        assert router.held == set() and kv.aio._leases == {}  # given back, not held until the TTL
        assert len(router.requests) == 1  # one give-back of that lease
    finally:
        finish.set()
        kv.close()


def test_a_lookup_async_not_cancelled_hands_its_hit_over(monkeypatch: pytest.MonkeyPatch) -> None:
    lease = (0, 42)
    kv, router, inside, finish = _client_whose_lookup_blocks(monkeypatch, lease)
    try:
        future = kv.lookup_async([1, 2, 3])
        assert inside.wait(10)
        finish.set()
        hit = future.result(10)
        assert hit.shard_leases == (lease,) and kv.aio._leases == {lease: 30_000}
        assert not future.cancel()  # too late: the caller holds the hit, the client keeps its leases
        time.sleep(0.1)
        assert router.requests == [] and router.held == {lease}
    finally:
        finish.set()
        kv.close()


def test_a_lookup_async_cancelled_before_it_starts_never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    lease = (0, 43)
    kv, router, inside, finish = _client_whose_lookup_blocks(monkeypatch, lease)
    gate = threading.Event()
    kv._loop.call_soon_threadsafe(gate.wait, 10)  # the loop is busy: the lookup is not started yet
    try:
        future = kv.lookup_async([1, 2, 3])
        assert future.cancel()
        gate.set()
        time.sleep(0.1)
        assert not inside.is_set() and kv.aio._leases == {} and router.requests == []
    finally:
        gate.set()
        finish.set()
        kv.close()

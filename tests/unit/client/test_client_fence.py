"""The client shell keeps the ownership fence (docs/design.md 3.4): a load that timed out returns with
its buffers untouched, and the transfer that tries to write afterwards finds their gate closed
and never writes into them. Also: an object that can never fit the in-flight budget ends the
load at once instead of waiting for room until the deadline."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvfabric.client import AsyncKvClient, ClientSettings, Hit, KvClient, LoadResult, sync
from kvfabric.dataplane.scatter import GateClosed, ScatterDest
from kvfabric.proto import directory as m
from tests.integration.clientkit import SPEC, prompt

SIZE = 4096


def hit_of(n_chunks: int, size: int = SIZE) -> Hit:
    groups = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC).chunk_groups(
        prompt(n_chunks * SPEC.layout.tokens_per_chunk)
    )
    replica = m.Replica(
        segment_id="s", incarnation=1, slot=1, slot_generation=1, data_addr="tcp://127.0.0.1:1"
    )
    objects = tuple(
        (
            m.ObjectLocation(
                chunk_index=c,
                member=m.Member(0, 0, 0),
                size_bytes=size,
                checksum=b"c" * 16,
                replicas=[replica],
            ),
        )
        for c in range(n_chunks)
    )
    return Hit(
        n_chunks * SPEC.layout.tokens_per_chunk,
        SPEC.layout.tokens_per_chunk,
        tuple(groups),
        (SPEC.layout.member,),
        objects,
        7,
    )


async def test_a_late_completion_never_writes_into_a_timed_out_loads_buffers() -> None:
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1", load_timeout_ms=200), SPEC)
    release = threading.Event()
    refused: list[str] = []

    def slow_fetch(
        locations: list[m.ObjectLocation], dests: list[ScatterDest], attempts: int, deadline_s: float
    ) -> list[str]:
        release.wait(10)
        for dest in dests:  # the transport writes into the engine's buffers — too late
            try:
                dest.write_from(memoryview(b"\xee" * dest.size), hashed=True)
            except GateClosed:
                refused.append("closed")
                return ["cancelled"] * len(dests)
        return ["ok"] * len(dests)

    kv.pool.fetch_many = slow_fetch  # type: ignore[method-assign, assignment]
    dests = [[bytearray(SIZE)] for _ in range(3)]
    started = time.monotonic()
    result = await kv.load(hit_of(3), dests)
    assert result.tokens == 0 and result.cause == "timeout" and time.monotonic() - started < 2
    release.set()
    for _ in range(100):  # let the late answers reach the loop
        await asyncio.sleep(0.01)
        if kv.table.counters.get("late_completions_total", 0) >= 1 and kv.table.held_bytes == 0:
            break
    assert refused == ["closed"]  # the gate stopped the late write
    assert all(bytes(d[0]) == bytes(SIZE) for d in dests)  # never written
    assert kv.table.counters["late_completions_total"] >= 1
    assert kv.table.held_bytes == 0 and kv.table.waiters_live == 0 and not kv._targets
    await kv.close()


async def test_an_object_larger_than_the_inflight_budget_ends_the_load_at_once() -> None:
    kv = AsyncKvClient(
        ClientSettings(nats_url="nats://unused:1", load_timeout_ms=5_000, load_inflight_bytes_max=SIZE), SPEC
    )
    started = time.monotonic()
    result = await kv.load(hit_of(2, size=2 * SIZE), [[bytearray(2 * SIZE)] for _ in range(2)])
    assert result.tokens == 0 and result.cause == "busy"
    assert time.monotonic() - started < 1.0  # not the 5 s deadline
    await kv.close()


def test_a_sync_load_whose_loop_stalls_still_takes_its_buffers_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # The loop cannot run the load's finally in time (stuck): KvClient.load closes the gate from
    # the engine's thread before it returns, so a worker thread still holding the transfer cannot
    # write into the buffers the engine reuses next.
    monkeypatch.setattr(sync, "_GRACE_S", 0.2)
    kv = KvClient(
        ClientSettings(nats_url="nats://127.0.0.1:1", connect_timeout_ms=200, load_timeout_ms=200), SPEC
    )
    started, go = threading.Event(), threading.Event()
    refused: list[str] = []

    def stuck_fetch(
        locations: list[m.ObjectLocation], dests: list[ScatterDest], attempts: int, deadline_s: float
    ) -> list[str]:
        started.set()
        go.wait(10)
        for dest in dests:
            try:
                dest.write_from(memoryview(b"\xee" * dest.size), hashed=True)
            except GateClosed:
                refused.append("closed")
                return ["cancelled"] * len(dests)
        return ["ok"] * len(dests)

    kv.aio.pool.fetch_many = stuck_fetch  # type: ignore[method-assign, assignment]
    dests = [[bytearray(SIZE)] for _ in range(2)]
    results: list[LoadResult] = []
    caller = threading.Thread(target=lambda: results.append(kv.load(hit_of(2), dests)))
    caller.start()
    assert started.wait(5)
    kv._loop.call_soon_threadsafe(time.sleep, 1.5)  # the loop stalls
    caller.join(5)
    assert results and results[0].tokens == 0 and results[0].cause == "timeout"
    go.set()  # the worker wakes up after the engine got its buffers back
    for _ in range(100):
        if refused:
            break
        time.sleep(0.02)
    assert refused == ["closed"] and all(bytes(d[0]) == bytes(SIZE) for d in dests)
    kv.close()

"""A load returns the verified prefix of its chunks, so once a chunk failed nothing after it is
used: the load stops waiting then. It waited for every object up to `load_timeout_ms`: a chunk
refused at once (its replica evicted) before chunks on a slow segment cost the engine the whole
timeout, then a recompute, and in vLLM the step's load budget (review, stop 67). A chunk before
the failed one is still waited for."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import msgspec
import pytest

from kvfabric.client import AsyncKvClient, ClientSettings, Hit
from kvfabric.proto import directory as m
from tests.integration.clientkit import SPEC
from tests.unit.client.test_client_fence import SIZE, hit_of

SLOW = "tcp://127.0.0.1:2"


def two_segments(failing_chunk: int) -> Hit:
    """Two one-object chunks: `failing_chunk`'s replica on a segment that refuses at once
    (`stale_generation`), the other's on a slow one."""
    hit = hit_of(2)
    slow = m.Replica(segment_id="t", incarnation=1, slot=2, slot_generation=1, data_addr=SLOW)
    rows = list(hit.objects)
    other = 1 - failing_chunk
    rows[other] = (msgspec.structs.replace(rows[other][0], replicas=[slow]),)
    return Hit(hit.tokens, hit.tokens_per_chunk, hit.groups, hit.members, tuple(rows), hit.lease_id)


@pytest.mark.parametrize("failing_chunk", [0, 1])
async def test_a_load_stops_waiting_once_nothing_left_can_be_used(failing_chunk: int) -> None:
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1", load_timeout_ms=5_000), SPEC)
    slow_done = threading.Event()

    def fetch(
        locations: Sequence[m.ObjectLocation], dests: object, attempts: int, deadline_s: float
    ) -> list[str]:
        if locations[0].replicas[0].data_addr != SLOW:
            return ["stale_generation"] * len(locations)  # evicted: known at once
        slow_done.wait(3.0)  # a slow segment (let go when the test is done with it)
        return ["ok"] * len(locations)

    kv.pool.fetch_many = fetch  # type: ignore[method-assign,assignment]
    kv.pool.fetch_local_now = lambda *a: None  # type: ignore[method-assign]
    started = time.monotonic()
    if failing_chunk == 1:  # chunk 0 is still of use: waited for
        threading.Timer(0.3, slow_done.set).start()
    result = await kv.load(two_segments(failing_chunk), [[bytearray(SIZE)], [bytearray(SIZE)]])
    took = time.monotonic() - started
    slow_done.set()
    await kv.close()
    assert result.cause == "stale_generation"  # the failed chunk's own cause
    if failing_chunk == 0:
        assert result.tokens == 0 and took < 1.0, took  # nothing after chunk 0 waited for
    else:
        assert result.chunks_loaded == 1 and 0.25 <= took < 2.0, took


async def test_a_load_that_lent_its_buffers_to_a_joined_transfer_waits_for_it() -> None:
    """Load A starts chunk 1's transfer (it writes into A's buffers); load B, whose engine holds
    chunk 0 already, joins it and will copy from them. A's chunk 0 fails: A still waits for the
    transfer B joined before it closes its gate, or B's object, fetched whole, failed
    `cancelled` (review of the early stop, stop 67)."""
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1", load_timeout_ms=5_000), SPEC)
    fail_go, slow_go = threading.Event(), threading.Event()

    def fetch(
        locations: Sequence[m.ObjectLocation], dests: object, attempts: int, deadline_s: float
    ) -> list[str]:
        if locations[0].replicas[0].data_addr != SLOW:
            fail_go.wait(3.0)
            return ["stale_generation"] * len(locations)
        slow_go.wait(3.0)
        return ["ok"] * len(locations)

    kv.pool.fetch_many = fetch  # type: ignore[method-assign,assignment]
    kv.pool.fetch_local_now = lambda *a: None  # type: ignore[method-assign]
    hit = two_segments(failing_chunk=0)
    a = asyncio.create_task(kv.load(hit, [[bytearray(SIZE)], [bytearray(SIZE)]]))
    await asyncio.sleep(0.05)
    b = asyncio.create_task(kv.load(hit, [[bytearray(SIZE)]], first_chunk=1))
    await asyncio.sleep(0.05)
    fail_go.set()  # A's chunk 0 fails
    await asyncio.sleep(0.1)
    assert not a.done()  # B still copies from A's buffers once chunk 1 lands
    slow_go.set()
    result_a, result_b = await a, await b
    await kv.close()
    assert result_a.tokens == 0 and result_a.cause == "stale_generation"
    assert result_b.chunks_loaded == 1 and result_b.cause == ""

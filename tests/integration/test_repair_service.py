"""The repair service on a live cluster: three segments in three zones, replica target 2, a
reading workload; SIGKILL one segment. Every published object returns to 2 replicas in the
zones left, every byte read during the repair is verified, and the copy rate stays within the
bandwidth budget."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import threading
import time

import nats
import pytest

from kvfabric.cluster.requests import request as nats_request
from kvfabric.format.ids import GroupKey
from kvfabric.proto import directory as m
from kvfabric.proto.repair import RepairStatus, RepairStatusRequest, repair_decoder
from kvfabric.proto.subjects import Service, endpoint_subject
from kvfabric.testing import NatsServer
from tests.integration.clientkit import (
    CHUNK_BYTES,
    TOKENS_PER_CHUNK,
    chunk_bytes,
    client,
    objects_for,
    prompt,
)
from tests.integration.cluster import (
    directory_call,
    directory_process,
    repair_process,
    segment_process,
    segment_state,
)

pytestmark = pytest.mark.integration

PROMPTS, CHUNKS = 24, 4
BUDGET_BYTES_PER_S = 4 << 20
BURST_BYTES = 256 << 10


async def repair_status(url: str) -> RepairStatus:
    nc = await nats.connect(url)
    try:
        reply = await nats_request(
            nc, endpoint_subject(Service.REPAIR, "status"), RepairStatusRequest(), repair_decoder, 5.0
        )
        assert isinstance(reply, RepairStatus)
        return reply
    finally:
        await nc.close()


async def replica_counts(url: str) -> list[int]:
    """Live replicas of every member of every published group."""
    nc = await nats.connect(url)
    counts: list[int] = []
    try:
        after = GroupKey(b"")
        while True:
            page = await directory_call(
                nc, "list_groups", m.ListGroups(after=after, limit=1000, with_objects=True)
            )
            assert isinstance(page, m.GroupList)
            counts += [len(o.replicas) for g in page.groups for o in g.objects]
            if not page.next_after:
                return counts
            after = page.next_after
    finally:
        await nc.close()


def reader_loop(
    url_nats: NatsServer, prompts: list[list[int]], stop: threading.Event, out: dict[str, list[float]]
) -> None:
    with client(url_nats, lookup_timeout_ms=1_000) as kv:
        while not stop.is_set():
            for tokens in prompts:
                started = time.perf_counter()
                hit = kv.lookup(tokens)
                dests = [[bytearray(CHUNK_BYTES)] for _ in range(hit.chunks)]
                result = kv.load(hit, dests)
                kv.release(hit)
                out["latency_s"].append(time.perf_counter() - started)
                n = result.tokens // TOKENS_PER_CHUNK
                out["chunks"].append(n)
                out["wrong"] += [c for c in range(n) if bytes(dests[c][0]) != chunk_bytes(tokens, c)]


def test_a_killed_segments_objects_return_to_their_target_within_the_budget(nats_server: NatsServer) -> None:
    prompts = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=300 + i) for i in range(PROMPTS)]
    # A survivor's beat may come late on a loaded 2-core host: 6 beats in the 1.5 s timeout, not 1.5
    # (a survivor declared down restarts empty, and its objects' other replica was on the victim).
    env = {
        "KVF_DIRECTORY_REPLICAS_DEFAULT": "2",
        "KVF_DIRECTORY_HEARTBEAT_TIMEOUT_MS": "1500",
        "KVF_DIRECTORY_HEARTBEAT_INTERVAL_MS": "250",
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(directory_process(nats_server, **env))
        victim = stack.enter_context(segment_process(nats_server, "seg-r1", KVF_SEGMENT_ZONE="z1"))
        stack.enter_context(segment_process(nats_server, "seg-r2", KVF_SEGMENT_ZONE="z2"))
        stack.enter_context(segment_process(nats_server, "seg-r3", KVF_SEGMENT_ZONE="z3"))
        stack.enter_context(
            repair_process(
                nats_server,
                **env,
                KVF_REPAIR_SCAN_MS="300",
                KVF_REPAIR_BANDWIDTH_BYTES_PER_S=str(BUDGET_BYTES_PER_S),
                KVF_REPAIR_BURST_BYTES=str(BURST_BYTES),
            )
        )
        with client(nats_server) as writer:
            for tokens in prompts:
                assert writer.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        assert asyncio.run(replica_counts(nats_server.url)) == [2] * (PROMPTS * CHUNKS)
        stop = threading.Event()
        seen: dict[str, list[float]] = {"latency_s": [], "chunks": [], "wrong": []}
        reader = threading.Thread(target=reader_loop, args=(nats_server, prompts, stop, seen), daemon=True)
        reader.start()
        time.sleep(0.5)
        killed = time.monotonic()
        victim.send_signal(signal.SIGKILL)

        async def repaired() -> float:
            saw_below = False
            while True:
                counts = await replica_counts(nats_server.url)
                saw_below |= any(c < 2 for c in counts)
                if saw_below and len(counts) == PROMPTS * CHUNKS and all(c == 2 for c in counts):
                    return time.monotonic() - killed
                await asyncio.sleep(0.1)

        repair_s = asyncio.run(asyncio.wait_for(repaired(), 60.0))
        status = asyncio.run(repair_status(nats_server.url))
        stop.set()
        reader.join(30.0)
        assert seen["wrong"] == [], "a wrong byte was consumed during repair"
        assert seen["chunks"] and min(seen["chunks"][-PROMPTS:]) == CHUNKS  # every prompt whole again
        # Objects that lost a replica on seg-r1: about 2/3 of them; each copy moves CHUNK_BYTES.
        assert status.bytes_copied >= PROMPTS * CHUNKS // 3 * CHUNK_BYTES
        # Within the budget: at most one burst plus the refill over the time repair took.
        assert status.bytes_copied <= BURST_BYTES + BUDGET_BYTES_PER_S * repair_s, (
            status.bytes_copied,
            repair_s,
        )
        p99 = statistics.quantiles(seen["latency_s"], n=100)[98] * 1000
        print(
            f"\nrepair: {repair_s:.2f} s to full target after SIGKILL, {status.bytes_copied} bytes copied, "
            f"read p99 {p99:.1f} ms over {len(seen['latency_s'])} loads, counters {status.counters}"
        )


def test_a_drained_segment_ends_empty_with_nothing_lost(nats_server: NatsServer) -> None:
    prompts = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=500 + i) for i in range(8)]
    env = {"KVF_DIRECTORY_REPLICAS_DEFAULT": "2"}
    with contextlib.ExitStack() as stack:
        stack.enter_context(directory_process(nats_server, **env))
        for i in (1, 2, 3):
            stack.enter_context(segment_process(nats_server, f"seg-d{i}", KVF_SEGMENT_ZONE=f"z{i}"))
        with client(nats_server) as writer:
            for tokens in prompts:
                assert writer.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        stack.enter_context(repair_process(nats_server, **env, KVF_REPAIR_SCAN_MS="200"))

        async def drain_and_wait() -> int:
            nc = await nats.connect(nats_server.url)
            try:
                state = await segment_state(nc, "seg-d1", draining=True)
                assert state.draining and state.used_bytes > 0
                while True:
                    state = await segment_state(nc, "seg-d1", draining=True)
                    if state.used_bytes == 0:
                        return state.used_bytes
                    await asyncio.sleep(0.1)
            finally:
                await nc.close()

        assert asyncio.run(asyncio.wait_for(drain_and_wait(), 30.0)) == 0
        assert asyncio.run(replica_counts(nats_server.url)) == [2] * (len(prompts) * CHUNKS)
        with client(nats_server) as reader:  # everything still reads whole, verified
            for tokens in prompts:
                hit = reader.lookup(tokens)
                out = [[bytearray(CHUNK_BYTES)] for _ in range(hit.chunks)]
                assert reader.load(hit, out).tokens == CHUNKS * TOKENS_PER_CHUNK
                assert all(bytes(out[c][0]) == chunk_bytes(tokens, c) for c in range(CHUNKS))
                assert all(r.segment_id != "seg-d1" for row in hit.objects for o in row for r in o.replicas)
                reader.release(hit)

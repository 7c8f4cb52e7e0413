"""The engine client against a real directory + segments: save, folded lookup, verified load,
coalescing, and every failure ending in a shorter (recomputed) prefix, never a hang or garbage."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvfabric.client import KvClient
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer, ServiceProcess, metric_value
from tests.integration.clientkit import (
    CHUNK_BYTES,
    TOKENS_PER_CHUNK,
    chunk_bytes,
    client,
    corrupt_stored_byte,
    objects_for,
    prompt,
)
from tests.integration.cluster import directory_call, directory_process, segment_process

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(nats_server: NatsServer) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    # No background scrub: a test that corrupts a byte checks the reader's verification, and a
    # scrub pass that found the byte first would free the replica under it (stale_generation).
    with (
        directory_process(nats_server) as directory,
        segment_process(nats_server, "seg-c", KVF_SEGMENT_SCRUB_BYTES_PER_S="0") as segment,
    ):
        yield directory, segment


def dests(n_chunks: int) -> list[list[bytearray]]:
    return [[bytearray(CHUNK_BYTES)] for _ in range(n_chunks)]


def metric(kv: KvClient, name: str, **labels: str) -> float:
    value = metric_value(generate_latest(kv.metrics.registry).decode(), name, **labels)
    return value or 0.0


def all_threads_stopped(pid: int) -> bool:
    """Every thread of `pid` in state T (stopped), from /proc."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            stat = (task / "stat").read_text()
            states.append(stat[stat.rindex(")") + 2])
    return bool(states) and all(state in "Tt" for state in states)


def leases_held(nats: NatsServer) -> int:
    """Read leases the directory holds, over every shard (a hit holds one per shard it touched)."""

    async def ask() -> int:
        import nats as nats_py

        nc = await nats_py.connect(nats.url)
        try:
            reply = await directory_call(nc, "list_leases", m.ListLeases())
            assert isinstance(reply, m.LeaseList)
            return sum(1 for lease in reply.leases if not lease.is_pin)
        finally:
            await nc.close()

    return asyncio.run(ask())


def test_save_then_a_fresh_client_loads_identical_bytes_and_extensions_fold(
    nats_server: NatsServer, cluster: object
) -> None:
    tokens = prompt(8 * TOKENS_PER_CHUNK + 5, seed=1)  # 8 full chunks and a partial one
    with client(nats_server) as writer:
        saved = writer.save(tokens, objects_for(tokens, 0, 8))
        assert saved.chunks_saved == 8 and saved.chunks_failed == 0
        again = writer.save(tokens, objects_for(tokens, 0, 8))
        assert again.chunks_existing == 8 and again.chunks_saved == 0
    with client(nats_server) as reader:
        hit = reader.lookup(tokens)
        assert hit.tokens == 8 * TOKENS_PER_CHUNK and hit.lease_id
        out = dests(8)
        result = reader.load(hit, out)
        assert result.tokens == 8 * TOKENS_PER_CHUNK and result.cause == ""
        assert all(bytes(out[c][0]) == chunk_bytes(tokens, c) for c in range(8))
        assert hit.shard_leases and leases_held(nats_server) == len(hit.shard_leases)  # one per shard
        reader.release(hit)
        # An extension shares the first 8 chunks; a capped lookup never asks for the whole prompt.
        longer = tokens[: 8 * TOKENS_PER_CHUNK] + prompt(4 * TOKENS_PER_CHUNK, seed=2)
        ext = reader.lookup(longer, max_tokens=6 * TOKENS_PER_CHUNK + 3)
        assert ext.tokens == 6 * TOKENS_PER_CHUNK
        part = dests(3)
        result = reader.load(ext, part, first_chunk=3)  # the engine already had chunks 0..2
        assert result.tokens == 6 * TOKENS_PER_CHUNK and result.chunks_loaded == 3
        assert bytes(part[0][0]) == chunk_bytes(tokens, 3)
        reader.release(ext)
        other = reader.lookup(prompt(4 * TOKENS_PER_CHUNK, seed=3))
        assert other.tokens == 0 and other.lease_id == 0 and other.cause == ""
        assert metric(reader, "kvfabric_client_loaded_tokens_total") == 11 * TOKENS_PER_CHUNK
        deadline = time.monotonic() + 5
        while leases_held(nats_server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leases_held(nats_server) == 0


def test_corrupted_stored_byte_shortens_the_load_to_the_verified_prefix(
    nats_server: NatsServer, cluster: object
) -> None:
    tokens = prompt(6 * TOKENS_PER_CHUNK, seed=4)
    with client(nats_server) as kv:
        assert kv.save(tokens, objects_for(tokens, 0, 6)).chunks_saved == 6
        hit = kv.lookup(tokens)
        corrupt_stored_byte(hit, 3)
        out = dests(6)
        result = kv.load(hit, out)
        kv.release(hit)
        assert result.tokens == 3 * TOKENS_PER_CHUNK and result.cause == "checksum"
        assert result.failed_chunks == (3, 4, 5)
        assert all(bytes(out[c][0]) == chunk_bytes(tokens, c) for c in range(3))
        # Loads write straight into the engine's buffers: chunk 3's unverified bytes may be in
        # out[3], but it is reported failed, so the engine recomputes over it (issue 20's rule).
        assert bytes(out[3][0]) != chunk_bytes(tokens, 3)
        assert metric(kv, "kvfabric_client_fallbacks_total", cause="checksum") == 1


def test_segment_killed_mid_load_ends_in_a_shorter_prefix_not_a_hang(
    nats_server: NatsServer, cluster: tuple[ServiceProcess, ServiceProcess]
) -> None:
    _, segment = cluster
    tokens = prompt(4 * TOKENS_PER_CHUNK, seed=5)
    with client(nats_server, load_timeout_ms=5_000, use_shm=False) as kv:
        assert kv.save(tokens, objects_for(tokens, 0, 4)).chunks_saved == 4
        hit = kv.lookup(tokens)
        segment.send_signal(signal.SIGSTOP)  # the load's requests reach a frozen segment ...
        # ... once every thread of it is stopped: a fresh-clone CI run (stop 62) saw this load
        # served whole, the SIGSTOP not yet in effect on a loaded 2-core machine
        deadline = time.monotonic() + 5.0
        while not all_threads_stopped(segment.pid):
            assert time.monotonic() < deadline, "the segment did not stop"
            time.sleep(0.01)
        killer = threading.Timer(0.5, segment.send_signal, (signal.SIGKILL,))  # ... that then dies
        killer.start()
        started = time.monotonic()
        result = kv.load(hit, dests(4))
        elapsed = time.monotonic() - started
        killer.join()
        kv.release(hit)
        assert result.tokens == 0 and result.cause in ("segment_unreachable", "transport_error")
        assert elapsed < 5.0
        segment.wait(10.0)


def test_directory_that_does_not_answer_is_a_miss_within_the_timeout(
    nats_server: NatsServer, cluster: tuple[ServiceProcess, ServiceProcess]
) -> None:
    directory, _ = cluster
    tokens = prompt(4 * TOKENS_PER_CHUNK, seed=6)
    with client(nats_server, lookup_timeout_ms=400, save_timeout_ms=400) as kv:
        assert kv.save(tokens, objects_for(tokens, 0, 4)).chunks_saved == 4
        directory.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            hit = kv.lookup(tokens)
            assert time.monotonic() - started < 2.0
            assert hit.tokens == 0 and hit.cause == "directory_timeout"
            saved = kv.save(prompt(2 * TOKENS_PER_CHUNK, seed=7), objects_for(prompt(32, seed=7), 0, 2))
            assert saved.chunks_saved == 0 and saved.chunks_failed == 2
        finally:
            directory.send_signal(signal.SIGCONT)
        # Back once it answers (it works through the backlog first: on a loaded host a lookup
        # right after SIGCONT may time out again, and is counted as one more fallback).
        deadline, late = time.monotonic() + 10.0, 0
        while (again := kv.lookup(tokens)).tokens < 4 * TOKENS_PER_CHUNK:
            assert again.cause == "directory_timeout" and time.monotonic() < deadline, again
            late += 1
            time.sleep(0.1)
        assert metric(kv, "kvfabric_client_fallbacks_total", cause="directory_timeout") == 1 + late


def test_concurrent_loads_of_one_hit_share_transfers(nats_server: NatsServer, cluster: object) -> None:
    tokens = prompt(8 * TOKENS_PER_CHUNK, seed=8)
    with client(nats_server) as kv:
        assert kv.save(tokens, objects_for(tokens, 0, 8)).chunks_saved == 8
        hit = kv.lookup(tokens)
        outs = [dests(8) for _ in range(4)]

        async def four_loads() -> list[int]:
            results = await asyncio.gather(*(kv.aio.load(hit, out) for out in outs))
            return [r.tokens for r in results]

        tokens_loaded = asyncio.run_coroutine_threadsafe(four_loads(), kv._loop).result(30)
        kv.release(hit)
        assert tokens_loaded == [8 * TOKENS_PER_CHUNK] * 4
        assert all(bytes(out[c][0]) == chunk_bytes(tokens, c) for out in outs for c in range(8))
        counters = kv.aio.table.counters
        assert counters["wants_total"] == 32
        # All four asked before any transfer answered: one transfer per object, three joins each.
        assert counters["transfers_started_total"] == 8 and counters["joins_total"] == 24
        assert kv.aio.table.transfers_held == 0 and kv.aio.table.waiters_live == 0


def test_unreachable_cluster_disables_the_client_without_raising() -> None:
    from kvfabric.client import ClientSettings, KvClient
    from kvfabric.testing.ports import free_port
    from tests.integration.clientkit import SPEC

    kv = KvClient(ClientSettings(nats_url=f"nats://127.0.0.1:{free_port()}", connect_timeout_ms=300), SPEC)
    try:
        assert not kv.enabled
        assert kv.lookup(prompt(64)).tokens == 0
        assert kv.save_async(prompt(32), objects_for(prompt(32), 0, 2)) is None
    finally:
        kv.close()


def test_a_load_larger_than_the_transfer_limit_waits_for_room_instead_of_failing(
    nats_server: NatsServer, cluster: object
) -> None:
    tokens = prompt(12 * TOKENS_PER_CHUNK, seed=9)
    # Remote: a co-located load of any size is copied on the engine's thread, past the table.
    with client(nats_server, transfers_max=2, load_inflight_bytes_max=2 * CHUNK_BYTES, use_shm=False) as kv:
        assert kv.save(tokens, objects_for(tokens, 0, 12)).chunks_saved == 12
        hit = kv.lookup(tokens)
        out = dests(12)
        result = kv.load(hit, out)
        kv.release(hit)
        assert result.tokens == 12 * TOKENS_PER_CHUNK and result.cause == ""
        assert all(bytes(out[c][0]) == chunk_bytes(tokens, c) for c in range(12))
        assert kv.aio.table.counters.get("busy_transfers_total", 0) > 0  # it really waited for room


def test_a_trace_id_follows_one_engine_request_through_directory_and_segment(
    nats_server: NatsServer, cluster: tuple[ServiceProcess, ServiceProcess]
) -> None:
    directory, _ = cluster
    tokens = prompt(2 * TOKENS_PER_CHUNK, seed=10)
    with client(nats_server) as kv:
        future = kv.save_async(tokens, objects_for(tokens, 0, 2), trace_id="engine-req-42")
        assert future is not None and future.result(30).chunks_saved == 2
        hit = kv.lookup(tokens, trace_id="engine-req-43")
        kv.release(hit)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        handled = [e for e in directory.events() if e.get("event") == "request_handled"]
        by_trace = {(e.get("trace_id"), e.get("endpoint")) for e in handled}
        released = {("engine-req-43", "lease_release"), ("engine-req-43", "lease_release_many")} & by_trace
        # The segment's confirm goes in the background since write receipts (gathered for 200 ms,
        # `KVF_SEGMENT_CONFIRM_LATER_GATHER_MS`, so after the commit): wait for it as for the release.
        if released and ("engine-req-42", "confirm") in by_trace:
            break
        time.sleep(0.1)
    # put_begin and put_commit from the client; confirm from the segment, carried over the data plane.
    assert {("engine-req-42", v) for v in ("put_begin", "confirm", "put_commit")} <= by_trace
    # Its two chunks' shards are led by one instance: one lookup_many and one lease_release_many
    # (or a lookup and a lease_release, when both chunks are of one shard).
    assert {("engine-req-43", "lease_release"), ("engine-req-43", "lease_release_many")} & by_trace
    assert {("engine-req-43", "lookup"), ("engine-req-43", "lookup_many")} & by_trace


@pytest.mark.parametrize("use_shm", [False, True], ids=["tcp", "co-located"])
def test_loads_and_saves_after_the_segment_closed_idle_connections_still_succeed(
    nats_server: NatsServer, use_shm: bool
) -> None:
    """A segment closes a data connection idle past `KVF_SEGMENT_IDLE_TIMEOUT_MS` (5 min by
    default). The client's pool kept it and handed it to the next transfer, which failed: after
    a quiet spell every load's first replica read failed (a one-replica chunk a miss) and every
    save's first write (review, 2026-12-06). Now a pooled connection the segment closed is
    dropped before use (`TcpDataClient.peer_closed`)."""
    tokens, other = prompt(4 * TOKENS_PER_CHUNK, seed=40), prompt(4 * TOKENS_PER_CHUNK, seed=41)
    with (
        directory_process(nats_server),
        segment_process(nats_server, "seg-idle", KVF_SEGMENT_IDLE_TIMEOUT_MS="300"),
        client(nats_server, use_shm=use_shm) as kv,
    ):
        assert kv.save(tokens, objects_for(tokens, 0, 4)).chunks_saved == 4
        time.sleep(1.0)  # the segment closes the pooled connections
        saved = kv.save(other, objects_for(other, 0, 4))
        assert saved.chunks_saved == 4 and saved.chunks_failed == 0
        for _ in range(2):  # the second after the first load's connections were closed too
            time.sleep(1.0)
            hit = kv.lookup(tokens)
            out = dests(4)
            result = kv.load(hit, out)
            kv.release(hit)
            assert result.tokens == 4 * TOKENS_PER_CHUNK and result.cause == ""
            assert all(bytes(out[c][0]) == chunk_bytes(tokens, c) for c in range(4))
        saved = kv.save(tokens + other, objects_for(tokens + other, 0, 8))
        assert saved.chunks_failed == 0
        assert kv.aio.pool.idle_dropped >= 2

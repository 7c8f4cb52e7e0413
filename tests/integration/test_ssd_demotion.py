"""Demotion instead of deletion (issue 23 step 3) on a live cluster: past the arena's high
watermark the eviction policy moves victims into the segment's disk tier (`demote.<segment>`),
and every chunk still hits through the client with identical bytes, loaded from disk; a full disk
stops demotion (counted, logged) and the arena keeps serving."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfabric.client import KvClient
from kvfabric.proto.segment import tier_of_slot
from kvfabric.testing import NatsServer, ServiceProcess, metric_value, scrape_metrics
from tests.integration.clientkit import (
    CHUNK_BYTES,
    TOKENS_PER_CHUNK,
    chunk_bytes,
    client,
    objects_for,
    prompt,
)
from tests.integration.cluster import directory_process, eviction_process, segment_process

pytestmark = pytest.mark.integration

SEGMENT = "seg-tier"
ARENA_BYTES = 8 << 20  # 128 chunks of 64 KiB
CHUNKS = 8  # per prompt


def ssd_env(directory: Path, ssd_bytes: int) -> dict[str, str]:
    return {
        "KVF_SEGMENT_SSD_PATH": str(directory),
        "KVF_SEGMENT_SSD_BYTES": str(ssd_bytes),
        "KVF_SEGMENT_SSD_SLOTS_MAX": "512",
    }


def policy(nats_server: NatsServer, **env: str) -> contextlib.AbstractContextManager[ServiceProcess]:
    return eviction_process(
        nats_server,
        KVF_EVICTION_HIGH_WATERMARK_PCT="50",
        KVF_EVICTION_LOW_WATERMARK_PCT="20",
        KVF_EVICTION_TICK_MS="50",
        KVF_EVICTION_SEGMENTS_REFRESH_MS="200",
        KVF_EVICTION_REFUSED_COOLDOWN_MS="200",
        **env,
    )


def tiers(reader: KvClient, tokens: list[int]) -> list[set[str]]:
    """Per chunk found, the tiers its replicas are in (lease released)."""
    hit = reader.lookup(tokens)
    try:
        return [{tier_of_slot(r.slot) for r in chunk[0].replicas} for chunk in hit.objects]
    finally:
        reader.release(hit)


def loaded_identical(reader: KvClient, tokens: list[int]) -> int:
    """Chunks looked up and loaded with identical bytes."""
    hit = reader.lookup(tokens)
    out = [[bytearray(CHUNK_BYTES)] for _ in range(hit.chunks)]
    result = reader.load(hit, out)
    reader.release(hit)
    n = result.tokens // TOKENS_PER_CHUNK
    return sum(bytes(out[c][0]) == chunk_bytes(tokens, c) for c in range(n))


def wait_for(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def segment_counter(segment: ServiceProcess, name: str) -> float:
    started = segment.wait_for_event("segment_started", 1.0)
    text = scrape_metrics(started["metrics_port"])
    return metric_value(text, "kvfabric_segment_events_total", name=name) or 0.0


def test_dram_pressure_demotes_to_disk_and_every_chunk_loads_from_there(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    prompts = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=300 + i) for i in range(10)]  # 62% of the arena
    with (
        directory_process(nats_server),
        segment_process(nats_server, SEGMENT, ARENA_BYTES, **ssd_env(tmp_path / "ssd", 64 << 20)) as segment,
        policy(nats_server) as evictor,
        client(nats_server) as writer,
        client(nats_server) as reader,
    ):
        for tokens in prompts:
            assert writer.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        saved_at = time.monotonic()
        # towards the low watermark (20%: about 25 chunks stay in the arena): the rest on disk
        wait_for(lambda: sum("dram" not in t for p in prompts for t in tiers(reader, p)) >= 40)
        settled_s = time.monotonic() - saved_at
        time.sleep(1.0)  # let the policy settle: it must not drop anything on its own
        on_disk = 0
        loads_started = time.monotonic()
        for tokens in prompts:
            found = tiers(reader, tokens)
            assert len(found) == CHUNKS  # demoted, never dropped
            on_disk += sum(t == {"ssd"} for t in found)
            assert loaded_identical(reader, tokens) == CHUNKS  # from disk where the arena let go
        loads_s = time.monotonic() - loads_started
        assert on_disk >= 40
        text = scrape_metrics(segment.wait_for_event("segment_started", 1.0)["metrics_port"])
        writes = metric_value(text, "kvfabric_segment_ssd_io_seconds_count", op="write") or 0.0
        write_s = metric_value(text, "kvfabric_segment_ssd_io_seconds_sum", op="write") or 0.0
        print(
            f"demotion: 40 chunks disk-only {settled_s:.2f} s after the last save; {writes:.0f} disk writes,"
            f" mean {1000 * write_s / max(writes, 1):.1f} ms; {on_disk} disk-only chunks of 80;"
            f" lookups + loads of all 80 (with the tier checks) {loads_s:.2f} s"
        )
        assert segment_counter(segment, "demotions") >= on_disk
        assert segment_counter(segment, "demote_dropped") >= on_disk
        evictor.wait_for_event("demoted", 1.0)


def test_a_full_disk_stops_demotion_and_the_arena_keeps_serving(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    prompts = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=500 + i) for i in range(10)]
    with (
        directory_process(nats_server),
        # 1 MiB of disk: 16 chunks at most, far from the 50 the arena's watermark wants out
        segment_process(nats_server, SEGMENT, ARENA_BYTES, **ssd_env(tmp_path / "ssd", 1 << 20)) as segment,
        policy(nats_server, KVF_EVICTION_SSD_HIGH_WATERMARK_PCT="100") as evictor,
        client(nats_server) as writer,
        client(nats_server) as reader,
    ):
        for tokens in prompts:
            assert writer.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        evictor.wait_for_event("demotion_stopped", 30.0)
        wait_for(lambda: segment_counter(segment, "demote_no_capacity") >= 1)
        demoted = segment_counter(segment, "demote_dropped")
        assert 1 <= demoted <= 16
        # The arena got its room all the same (victims dropped instead), and serves what it holds.
        wait_for(lambda: sum(len(tiers(reader, p)) for p in prompts) <= 80 - 40)
        for tokens in prompts:
            n = len(tiers(reader, tokens))
            assert loaded_identical(reader, tokens) == n
        fresh = prompt(CHUNKS * TOKENS_PER_CHUNK, seed=999)
        assert writer.save(fresh, objects_for(fresh, 0, CHUNKS)).chunks_saved == CHUNKS
        assert loaded_identical(reader, fresh) == CHUNKS

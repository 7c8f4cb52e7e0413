"""Demotion instead of deletion (issue 23 step 3) on a live cluster: past the arena's high
watermark the eviction policy moves victims into the segment's disk tier (`demote.<segment>`),
and every chunk still hits through the client with identical bytes, loaded from disk; a full disk
stops demotion (counted, logged) and the arena keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path

import nats
import pytest

from kvfabric.client import KvClient
from kvfabric.proto import directory as m
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
from tests.integration.cluster import directory_call, directory_process, eviction_process, segment_process

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
        # on disk: objects moved there, or copied (a demoted tail's head: its arena replica kept)
        written = segment_counter(segment, "demote_dropped") + segment_counter(segment, "demote_kept")
        assert 1 <= written <= 16

        # The arena got its room all the same (victims dropped instead), and serves what it holds.
        # victims dropped instead: the arena back under its high watermark (50 %: 64 chunks)
        def arena_relieved() -> bool:
            found = [t for p in prompts for t in tiers(reader, p)]
            return len(found) < 80 and sum("dram" in t for t in found) <= 64

        wait_for(arena_relieved)

        # and nothing on disk is unreachable: a dropped head took its demoted tails with it (every
        # disk object is found by a lookup, disk-only or a head's copy beside its arena replica)
        def disk_findable() -> bool:
            text = scrape_metrics(segment.wait_for_event("segment_started", 1.0)["metrics_port"])
            on_disk = metric_value(text, "kvfabric_segment_tier_objects", tier="ssd")
            return on_disk == sum("ssd" in t for p in prompts for t in tiers(reader, p))

        wait_for(disk_findable)
        for tokens in prompts:
            n = len(tiers(reader, tokens))
            assert loaded_identical(reader, tokens) == n
        fresh = prompt(CHUNKS * TOKENS_PER_CHUNK, seed=999)
        assert writer.save(fresh, objects_for(fresh, 0, CHUNKS)).chunks_saved == CHUNKS
        assert loaded_identical(reader, fresh) == CHUNKS


async def disk_replicas_listed(url: str, segment_id: str) -> int:
    """Replicas on `segment_id`'s disk tier in the directory's published records."""
    nc = await nats.connect(url)
    try:
        reply = await directory_call(nc, "list_groups", m.ListGroups(limit=1000, with_objects=True))
        assert isinstance(reply, m.GroupList)
        return sum(
            r.segment_id == segment_id and tier_of_slot(r.slot) == "ssd"
            for g in reply.groups
            for o in g.objects
            for r in o.replicas
        )
    finally:
        await nc.close()


def test_a_segment_killed_mid_demotion_restarts_with_no_torn_object_and_no_leaked_disk_space(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """SIGKILL while the policy demotes, restart on the same disk file: every object found loads
    with identical bytes, and once the orphans are freed the disk holds exactly what the
    directory lists (no leaked space)."""
    prompts = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=700 + i) for i in range(10)]
    disk = ssd_env(tmp_path / "ssd", 64 << 20)
    with (
        directory_process(nats_server, KVF_DIRECTORY_LEASE_TTL_MS_MAX="1000"),  # the grace before frees
        policy(nats_server),
        client(nats_server) as writer,
        client(nats_server) as reader,
    ):
        with segment_process(nats_server, SEGMENT, ARENA_BYTES, **disk) as segment:
            for tokens in prompts:
                assert writer.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS

            # At least one whole prompt with a disk replica per chunk (a lookup folds from chunk 0:
            # without one nothing is findable after the restart, however much was recovered; the
            # kill at a demotion count alone left none in 2 of 5 runs on a loaded VM).
            def one_prompt_on_disk() -> bool:
                return segment_counter(segment, "demotions") >= 5 and any(
                    len(found) == CHUNKS and all("ssd" in t for t in found)
                    for found in (tiers(reader, tokens) for tokens in prompts)
                )

            wait_for(one_prompt_on_disk, timeout_s=30.0)
            segment.send_signal(signal.SIGKILL)  # demotions still running (about 50 are due)
            segment.wait(10.0)
        with segment_process(nats_server, SEGMENT, ARENA_BYTES, **disk) as segment:
            started = segment.wait_for_event("segment_started", 1.0)
            recovered = started["ssd_recovered_objects"]
            assert recovered >= 5
            found = 0
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the directory adopts the disk tier as it registers
                found = sum(len(tiers(reader, tokens)) for tokens in prompts)
                if found:
                    break
                time.sleep(0.2)
            assert found >= 1
            for tokens in prompts:  # no torn object: whatever is found loads intact
                assert loaded_identical(reader, tokens) == len(tiers(reader, tokens))

            # No leaked space: the disk holds exactly the disk replicas the directory lists (orphans,
            # objects of groups the rebuild found incomplete, freed after the grace period).
            def settled() -> bool:
                text = scrape_metrics(started["metrics_port"])
                on_disk = metric_value(text, "kvfabric_segment_tier_objects", tier="ssd")
                used = metric_value(text, "kvfabric_segment_tier_bytes", tier="ssd")
                listed = asyncio.run(disk_replicas_listed(nats_server.url, SEGMENT))
                return on_disk == listed and used == listed * CHUNK_BYTES

            wait_for(settled, timeout_s=30.0)
            print(f"kill mid-demotion: {recovered} objects recovered, {found} chunks found after restart")

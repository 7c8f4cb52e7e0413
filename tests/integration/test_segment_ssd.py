"""A segment process with a disk tier: it recovers what its file holds at start (after a clean stop
and after SIGKILL), lists it in its report under its new incarnation, serves it over TCP with
identical bytes, exports its figures, and refuses a file made for another configuration. The
directory adopts what it recovered (the registration says it holds objects: a shard rebuild), so
a reader's lookup hits the disk replicas and the client's data path loads them."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from kvfabric.client.transfers import SegmentPool
from kvfabric.cluster.requests import request
from kvfabric.dataplane.scatter import ScatterDest, WriteGate
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.checksum import checksum
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE, ReportRequest, SegmentReport, segment_decoder, tier_of_slot
from kvfabric.proto.subjects import segment_subject
from kvfabric.segment_storage.ssd import SsdIo, SsdTier
from kvfabric.testing import NatsServer, ServiceProcess, metric_value, scrape_metrics_async
from tests.integration.cluster import (
    directory_call,
    directory_process,
    segment_process,
    service_env,
    signed_ref,
)
from tests.unit.core.dirkit import groups, key

pytestmark = pytest.mark.integration

SEGMENT = "seg-ssd"
SSD_BYTES = 32 << 20
SSD_SLOTS = 128


def ssd_env(directory: Path, ssd_bytes: int = SSD_BYTES) -> dict[str, str]:
    return {
        "KVF_SEGMENT_SSD_PATH": str(directory),
        "KVF_SEGMENT_SSD_BYTES": str(ssd_bytes),
        "KVF_SEGMENT_SSD_SLOTS_MAX": str(SSD_SLOTS),
    }


def prefill(directory: Path, count: int, keys: list[bytes] | None = None) -> dict[bytes, bytes]:
    """Objects written into the segment's disk tier file by a tier of its own (as a demotion of an
    earlier incarnation would have left them)."""
    io = SsdIo(0, 64, 1 << 20)
    tier = SsdTier(directory, SEGMENT, SSD_BYTES, SSD_SLOTS, direct=True, io=io, read_bytes_max=1 << 30)
    objects = {}
    try:
        for i in range(count):
            key = keys[i] if keys is not None else f"ssd-object-{i}".encode()
            data = os.urandom(100_000 * (i + 1))
            tier.write(memoryview(data), key, checksum(data))
            objects[key] = data
    finally:
        io.close()
        tier.close()
    return objects


async def report_all(nc: NatsClient, incarnation_of: list[int]) -> dict[bytes, tuple[int, int, int, bytes]]:
    """Every object the segment reports, paged (3 a page), as key -> (slot, generation, size, checksum)."""
    out: dict[bytes, tuple[int, int, int, bytes]] = {}
    after = -1
    while True:
        reply = await request(
            nc,
            segment_subject(SEGMENT, "report"),
            ReportRequest(epoch=1, shard=1000, after_slot=after, limit=3),  # a shard nobody leads
            segment_decoder,
            5.0,
        )
        assert isinstance(reply, SegmentReport)
        incarnation_of.append(reply.incarnation)
        for h in reply.objects:
            out[h.key] = (h.slot, h.slot_generation, h.size_bytes, h.checksum)
        if reply.next_after_slot < 0:
            return out
        after = reply.next_after_slot


async def check_served(
    nc: NatsClient, segment: ServiceProcess, objects: dict[bytes, bytes]
) -> dict[bytes, int]:
    started = segment.wait_for_event("segment_started", 1.0)
    assert started["ssd_recovered_objects"] == len(objects)
    assert started["ssd_recovered_bytes"] == sum(len(d) for d in objects.values())
    incarnations: list[int] = []
    held = await report_all(nc, incarnations)
    assert set(incarnations) == {started["incarnation"]}
    assert set(held) == set(objects)
    with TcpDataClient.connect(started["data_addr"]) as client:
        for key, data in objects.items():
            slot, generation, size, digest = held[key]
            assert slot >= SSD_SLOT_BASE and size == len(data) and digest == checksum(data)
            ref = signed_ref(SEGMENT, started["incarnation"], slot, generation, size)
            dest = bytearray(size)
            ((result, got),) = await asyncio.to_thread(client.get_hashed, [ref], [dest])
            assert result.status == "ok" and got == digest and bytes(dest) == data
    return {key: held[key][0] for key in held}


async def test_a_segment_recovers_and_serves_its_disk_tier(
    nats_server: NatsServer, nats_client: NatsClient, tmp_path: Path
) -> None:
    ssd_dir = tmp_path / "ssd"
    objects = prefill(ssd_dir, 5)
    with directory_process(nats_server):
        with segment_process(nats_server, SEGMENT, 16 << 20, **ssd_env(ssd_dir)) as segment:
            slots = await check_served(nats_client, segment, objects)
            started = segment.wait_for_event("segment_started", 1.0)
            text = await scrape_metrics_async(started["metrics_port"])
            assert metric_value(text, "kvfabric_segment_ssd_objects") == 5
            assert metric_value(text, "kvfabric_segment_ssd_capacity_bytes") == SSD_BYTES
            assert (
                metric_value(text, "kvfabric_segment_ssd_io_seconds_count", op="read") == 5
            )  # check_served's
            assert metric_value(text, "kvfabric_segment_ssd_io_seconds_bucket", op="read", le="+Inf") == 5
            segment.send_signal(signal.SIGKILL)  # no clean stop: the file is all there is
            segment.wait(10.0)
        with segment_process(nats_server, SEGMENT, 16 << 20, **ssd_env(ssd_dir)) as segment:
            assert await check_served(nats_client, segment, objects) == slots  # same slots again
            segment.stop(timeout_s=10.0)
            assert segment.returncode == 0
        assert (ssd_dir / f"kvf-{SEGMENT}.ssd").exists()  # a clean stop keeps the file

        refused = ServiceProcess.python_module(
            "kvfabric.segment_storage",
            "--nats-url",
            nats_server.url,
            "--metrics-port",
            "0",
            "--log-json",
            env=service_env(
                KVF_SEGMENT_ID=SEGMENT, KVF_SEGMENT_BYTES=str(16 << 20), **ssd_env(ssd_dir, SSD_BYTES * 2)
            ),
        )
        refused.start()
        try:
            assert refused.wait(20.0) == 2
            event = refused.wait_for_event("ssd_file_refused", 1.0)
            assert "another configuration" in event["error"] and "KVF_SEGMENT_SSD_BYTES" in event["error"]
        finally:
            refused.stop(timeout_s=5.0)


async def test_the_directory_adopts_a_restarted_segment_s_disk_tier(
    nats_server: NatsServer, nats_client: NatsClient, tmp_path: Path
) -> None:
    """Chunk groups whose objects are in the disk tier only (as after a restart): the segment
    registers with `disk_objects`, the directory rebuilds its shards from the reports, and a
    lookup hits them with disk replicas that the client's pool loads, checksum verified."""
    ssd_dir = tmp_path / "ssd"
    chunk_groups = groups(3, seed=23)
    objects = prefill(ssd_dir, 3, [key(g) for g in chunk_groups])
    with directory_process(nats_server), segment_process(nats_server, SEGMENT, 16 << 20, **ssd_env(ssd_dir)):
        locations: list[m.ObjectLocation] = []
        for g in chunk_groups:  # one lookup per group: each is its own shard's
            for _ in range(100):  # the rebuild starts as the segment registers
                reply = await directory_call(
                    nats_client, "lookup", m.Lookup(holder_id="reader", groups=[g.group_id()])
                )
                assert isinstance(reply, m.LookupReply)
                if reply.hit_chunks == 1:
                    locations.append(reply.objects[0])
                    break
                await asyncio.sleep(0.2)
        assert len(locations) == 3, "the directory never adopted the disk tier's groups"
        pool = SegmentPool(connections_per_segment_max=2, timeout_s=10, use_shm=True)
        try:
            for location, g in zip(locations, chunk_groups, strict=True):
                (replica,) = location.replicas
                assert tier_of_slot(replica.slot) == "ssd" and replica.segment_id == SEGMENT
                data = objects[key(g)]
                assert location.size_bytes == len(data) and location.checksum == checksum(data)
                dest = bytearray(len(data))
                gate = WriteGate()
                status = await asyncio.to_thread(
                    pool.fetch, location, ScatterDest([memoryview(dest)], gate), 1
                )
                gate.close()
                assert status == "ok" and bytes(dest) == data
        finally:
            pool.close()

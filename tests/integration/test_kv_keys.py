"""A KV bucket's keys from its stream's subjects (`kvfabric.directory.kv_keys`), and the segment
registry's listing that only grows (`SegmentRegistry.all`), against a real nats-server and a
3-node NATS cluster (where nats-py's `keys()` can end a listing early: docs/directory-ha.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats
import pytest
from nats.js.api import KeyValueConfig, StorageType

from kvfabric.directory import segment_registry
from kvfabric.directory.kv_buckets import SEGMENTS_BUCKET
from kvfabric.directory.kv_keys import bucket_keys
from kvfabric.directory.segment_registry import SegmentRegistry
from kvfabric.proto import directory as m
from kvfabric.testing.nats_cluster import NatsCluster
from kvfabric.testing.nats_server import NatsServer

pytestmark = [pytest.mark.timeout(120)]


def registration(segment_id: str, incarnation: int = 1) -> m.RegisterSegment:
    return m.RegisterSegment(
        segment_id=segment_id,
        incarnation=incarnation,
        capacity_bytes=1 << 30,
        domain=m.FailureDomain(host="h", zone="z"),
        data_addr="tcp://127.0.0.1:40000",
    )


async def _keys_of_each_node(urls: list[str], replicas: int) -> list[list[str]]:
    writer = await nats.connect(urls[0])
    try:
        js = writer.jetstream(timeout=5)
        for bucket in ("EMPTY", "B"):
            config = KeyValueConfig(bucket=bucket, storage=StorageType.FILE, replicas=replicas)
            await js.create_key_value(config)
        assert await bucket_keys(js, "EMPTY") == []
        kv = await js.key_value("B")
        for key in ("seg-b", "seg-a", "member-x", "seg-b"):  # seg-b twice: one key
            await kv.put(key, b"v")
        seen = []
        for url in urls:
            nc = await nats.connect(url)
            try:
                for _ in range(10):  # a rebalancing instance lists its members every 100 ms
                    keys = await bucket_keys(nc.jetstream(timeout=5), "B")
                seen.append(keys)
            finally:
                await nc.close()
        # No consumer left behind (nats-py's `keys()` leaves one per listing for 5 minutes).
        assert (await js.stream_info("KV_B")).state.consumer_count == 0
        return seen
    finally:
        await writer.close()


def test_a_buckets_keys_are_listed_on_a_single_server(nats_server: NatsServer) -> None:
    assert asyncio.run(_keys_of_each_node([nats_server.url], 1)) == [["member-x", "seg-a", "seg-b"]]


def test_a_buckets_keys_are_listed_from_every_node_of_a_cluster(tmp_path: Path) -> None:
    with NatsCluster(tmp_path) as cluster:  # (a start that fails part-way stops its nodes)
        seen = asyncio.run(_keys_of_each_node(cluster.urls, 3))
    assert seen == [["member-x", "seg-a", "seg-b"]] * 3


async def _registry(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    writer_nc, reader_nc = await nats.connect(url), await nats.connect(url)
    try:
        writer = await SegmentRegistry.open(writer_nc)
        reader = await SegmentRegistry.open(reader_nc)
        assert await reader.all() == []
        await writer.put(registration("seg-2"))
        await writer.put(registration("seg-1"))
        assert [r.segment_id for r in await reader.all()] == ["seg-1", "seg-2"]

        # A registration written again (a restarted segment) is read as its newest.
        await writer.put(registration("seg-1", incarnation=2))
        assert [(r.segment_id, r.incarnation) for r in await reader.all()] == [("seg-1", 2), ("seg-2", 1)]

        # A listing that misses keys still names every registration this process saw...
        async def listing_misses_all(js: object, bucket: str) -> list[str]:
            return []

        monkeypatch.setattr(segment_registry, "bucket_keys", listing_misses_all)
        assert [(r.segment_id, r.incarnation) for r in await reader.all()] == [("seg-1", 2), ("seg-2", 1)]
        # ... and one it read by id (a heartbeat's introduction), or wrote itself.
        await writer.put(registration("seg-3"))
        assert (await reader.get("seg-3")) == registration("seg-3")
        await reader.put(registration("seg-4"))
        assert [r.segment_id for r in await reader.all()] == ["seg-1", "seg-2", "seg-3", "seg-4"]

        # An older incarnation read later (a lagging replica, a recreated bucket) never replaces
        # a newer one: written to the bucket behind the registry's back, then read by id.
        raw = await reader_nc.jetstream().key_value(SEGMENTS_BUCKET)
        await raw.put("seg-1", msgspec.msgpack.encode(registration("seg-1", incarnation=1)))
        assert (await reader.get("seg-1")) == registration("seg-1", incarnation=2)
    finally:
        await writer_nc.close()
        await reader_nc.close()


def test_the_segment_registry_lists_every_registration_and_never_forgets_one(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(_registry(nats_server.url, monkeypatch))

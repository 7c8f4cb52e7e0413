"""Every metric name docs/metrics.md documents is served: the directory's and a segment's
`/metrics` after some traffic, and the client's registry. The dashboard uses only these names
(`make compose-check`), so a renamed metric fails here instead of leaving an empty panel."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import nats
import pytest
from prometheus_client import generate_latest

from kvfabric.cluster.requests import request
from kvfabric.proto.eviction import EvictionStatus, EvictionStatusRequest, eviction_decoder
from kvfabric.proto.prefetch import PrefetchStatusRequest, prefetch_decoder
from kvfabric.proto.repair import RepairStatusRequest, repair_decoder
from kvfabric.proto.subjects import Service, endpoint_subject
from kvfabric.testing import NatsServer, scrape_metrics
from tests.integration.clientkit import client, objects_for, prompt
from tests.integration.cluster import (
    directory_process,
    eviction_process,
    prefetch_process,
    repair_process,
    segment_process,
)

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
SUFFIXED = ("_total", "_bucket", "_count", "_sum")


def documented(service: str) -> set[str]:
    names = set(re.findall(r"`(kvfabric_[a-z_<>]+)`", DOC.read_text()))
    if service in (
        "directory",
        "segment",
        "eviction",
        "repair",
        "prefetch",
    ):  # the runtime's metrics: services only
        names = {n.replace("<service>", service) for n in names}
    return {n for n in names if n.startswith(f"kvfabric_{service}_") and "<" not in n}


def served(exposition: str) -> set[str]:
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
    return names | {n + "_total" for n in names}  # counters are documented with their _total sample


def missing(service: str, exposition: str) -> set[str]:
    have = served(exposition)
    return {n for n in documented(service) if n not in have and n.removesuffix("_total") not in have}


async def eviction_status(url: str) -> None:
    nc = await nats.connect(url)
    try:
        for _ in range(100):  # the policy replays the events stream, then knows the segment
            reply = await request(
                nc,
                endpoint_subject(Service.EVICTION, "status"),
                EvictionStatusRequest(),
                eviction_decoder,
                5.0,
            )
            if isinstance(reply, EvictionStatus) and reply.pools:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the policy never learned the segment's capacity")
    finally:
        await nc.close()


async def status_of(url: str, service: Service, message: Any, decoder: Any) -> None:
    nc = await nats.connect(url)
    try:
        await request(nc, endpoint_subject(service, "status"), message, decoder, 5.0)
    finally:
        await nc.close()


def test_services_and_client_serve_every_documented_metric(nats_server: NatsServer) -> None:
    with (
        directory_process(nats_server) as directory,
        segment_process(nats_server, "seg-m") as segment,
        eviction_process(nats_server, KVF_EVICTION_SEGMENTS_REFRESH_MS="100") as policy,
        repair_process(nats_server, KVF_REPAIR_SCAN_MS="100") as repair,
        prefetch_process(nats_server) as prefetch,
    ):
        tokens = prompt(64)
        with client(nats_server, use_shm=False) as kv:  # over TCP: the segment counts the reads
            assert kv.save(tokens, objects_for(tokens, 0, 4)).chunks_saved == 4
            hit = kv.lookup(tokens)
            kv.load(hit, [[bytearray(len(objects_for(tokens, 0, 1)[0][0]))] for _ in range(4)])
            kv.release(hit)
            client_text = generate_latest(kv.metrics.registry).decode()
        directory_port = directory.wait_for_event("directory_started", 1.0)["metrics_port"]
        segment_port = segment.wait_for_event("segment_started", 1.0)["metrics_port"]
        directory_text = scrape_metrics(directory_port)
        segment_text = scrape_metrics(segment_port)
        asyncio.run(eviction_status(nats_server.url))  # one request: the runtime's series exist
        policy_port = policy.wait_for_event("eviction_started", 1.0)["metrics_port"]
        eviction_text = scrape_metrics(policy_port)
        asyncio.run(status_of(nats_server.url, Service.REPAIR, RepairStatusRequest(), repair_decoder))
        asyncio.run(status_of(nats_server.url, Service.PREFETCH, PrefetchStatusRequest(), prefetch_decoder))
        repair_text = scrape_metrics(repair.wait_for_event("repair_started", 1.0)["metrics_port"])
        prefetch_text = scrape_metrics(prefetch.wait_for_event("prefetch_started", 1.0)["metrics_port"])
    assert documented("directory") and documented("segment") and documented("client")
    assert missing("directory", directory_text) == set()
    assert missing("segment", segment_text) == set()
    assert missing("client", client_text) == set()
    assert documented("eviction") and missing("eviction", eviction_text) == set()
    assert documented("repair") and missing("repair", repair_text) == set()
    assert documented("prefetch") and missing("prefetch", prefetch_text) == set()
    assert 'kvfabric_eviction_pool_used_bytes{segment="seg-m"}' in eviction_text
    assert 'kvfabric_segment_events_total{name="bytes_granted"}' in segment_text

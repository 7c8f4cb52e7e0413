"""Every metric name docs/metrics.md documents is served: the directory's and a segment's
`/metrics` after some traffic, and the client's registry. The dashboard uses only these names
(`make compose-check`), so a renamed metric fails here instead of leaving an empty panel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kvfabric.testing import NatsServer, scrape_metrics
from tests.integration.clientkit import client, objects_for, prompt
from tests.integration.cluster import directory_process, segment_process

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
SUFFIXED = ("_total", "_bucket", "_count", "_sum")


def documented(service: str) -> set[str]:
    names = set(re.findall(r"`(kvfabric_[a-z_<>]+)`", DOC.read_text()))
    if service in ("directory", "segment"):  # the runtime's metrics: services only
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


def test_services_and_client_serve_every_documented_metric(nats_server: NatsServer) -> None:
    with directory_process(nats_server) as directory, segment_process(nats_server, "seg-m") as segment:
        tokens = prompt(64)
        with client(nats_server) as kv:
            assert kv.save(tokens, objects_for(tokens, 0, 4)).chunks_saved == 4
            hit = kv.lookup(tokens)
            kv.load(hit, [[bytearray(len(objects_for(tokens, 0, 1)[0][0]))] for _ in range(4)])
            kv.release(hit)
            client_text = generate_latest(kv.metrics.registry).decode()
        directory_port = directory.wait_for_event("directory_started", 1.0)["metrics_port"]
        segment_port = segment.wait_for_event("segment_started", 1.0)["metrics_port"]
        directory_text = scrape_metrics(directory_port)
        segment_text = scrape_metrics(segment_port)
    assert documented("directory") and documented("segment") and documented("client")
    assert missing("directory", directory_text) == set()
    assert missing("segment", segment_text) == set()
    assert missing("client", client_text) == set()
    assert 'kvfabric_segment_events_total{name="bytes_granted"}' in segment_text

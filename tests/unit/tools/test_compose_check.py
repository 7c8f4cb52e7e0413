"""`make compose-check` passes on the checked-in compose/ and catches broken copies of it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.unit.tools.toolkit import load_tool

REPO = Path(__file__).resolve().parents[3]


def test_checked_in_compose_is_consistent() -> None:
    assert load_tool("compose_check").check() == []


@pytest.mark.parametrize(
    ("path", "old", "new", "complaint"),
    [
        (
            "docker-compose.yml",
            "kvfabric.segment_storage",
            "kvfabric.segment_store",
            "not a kvfabric service",
        ),
        ("docker-compose.yml", "KVF_SEGMENT_ID: seg-3", "KVF_SEGMENT_ID: seg-2", "unique"),
        ("docker-compose.yml", "KVF_SEGMENT_HOST: host-3", "KVF_SEGMENT_HOST: host-2", "failure domain"),
        ("docker-compose.yml", "./prometheus.yml", "./prometheus-missing.yml", "does not exist"),
        ("prometheus.yml", '"segment-3:9100"', '"segment-3:9101"', "prometheus targets"),
        (
            "grafana/dashboards/kvfabric.json",
            "kvfabric_directory_leases",
            "kvfabric_directory_lease_count",
            "docs/metrics.md",
        ),
        ("Dockerfile", "./services/segment_storage", "./services/other", "does not install"),
        ("docker-compose.yml", '"-c", "/auth/nats-auth.conf", ', "", "nats: must load"),
        ("docker-compose.yml", "/auth/passwords/svc-repair", "/auth/passwords/svc-prefetch", "svc-repair"),
        ("docker-compose.yml", "service_completed_successfully", "service_started", "wait for auth-init"),
        ("docker-compose.yml", "${KVF_CLUSTER_SECRET:?set", "${KVF_CLUSTER_SECRET:-x", "never defaulted"),
        ("docker-compose.yml", 'ports: ["4222:4222"]', 'ports: ["4222:4222", "8222:8222"]', "8222"),
        ("docker-compose.yml", 'KVF_METRICS_HOST: "0.0.0.0"', 'KVF_METRICS_HOST: "127.0.0.1"', "loopback"),
        ("docker-compose.yml", "stop_grace_period: 30s", "stop_grace_period: 10s", "stop deadline"),
    ],
)
def test_broken_copies_are_caught(tmp_path: Path, path: str, old: str, new: str, complaint: str) -> None:
    compose = tmp_path / "compose"
    shutil.copytree(REPO / "compose", compose)
    target = compose / path
    text = target.read_text()
    assert old in text
    target.write_text(text.replace(old, new))
    problems = load_tool("compose_check").check(compose)
    assert any(complaint in p for p in problems), problems

"""`NatsCluster.start` stops the nodes it started when it fails part-way (a leaked node kept its
ports and store for the rest of a test run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.testing.nats_cluster import NatsCluster
from kvfabric.testing.nats_server import NatsServerError


class FakeNode:
    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.running = False

    def start(self) -> None:
        if self.fails:
            raise NatsServerError("would not start")
        self.running = True

    def stop(self) -> None:
        self.running = False


def test_a_node_that_will_not_start_stops_the_ones_before_it(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path)
    nodes = [FakeNode(), FakeNode(), FakeNode(fails=True)]
    cluster.nodes = nodes  # type: ignore[assignment]
    with pytest.raises(NatsServerError):
        cluster.start()
    assert [n.running for n in nodes] == [False, False, False]


def test_no_meta_leader_in_time_stops_every_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = NatsCluster(tmp_path)
    nodes = [FakeNode(), FakeNode(), FakeNode()]
    cluster.nodes = nodes  # type: ignore[assignment]

    def no_leader(timeout_s: float) -> None:
        raise NatsServerError(f"no JetStream meta leader after {timeout_s} s")

    monkeypatch.setattr(cluster, "wait_meta_leader", no_leader)
    with pytest.raises(NatsServerError), cluster:
        pass
    assert [n.running for n in nodes] == [False, False, False]

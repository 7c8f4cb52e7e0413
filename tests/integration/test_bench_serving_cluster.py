"""`bench.serving`'s cluster runs as deployed: a segment the directory declared down (it exits 75
by design) is restarted by the supervisor, and the benchmark sees it (issue 24: in the
2026-12-01 22:27 run nothing restarted the segments, and (c), (d) loaded nothing from kvfabric)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from bench.serving import Cluster

pytestmark = pytest.mark.integration

HEARTBEAT_TIMEOUT_S = 5.0  # the directory's default (KVF_DIRECTORY_HEARTBEAT_TIMEOUT_MS)


def wait_started(cluster: Cluster, i: int, more_than: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cluster.segment_starts(i) <= more_than:
        assert time.monotonic() < deadline, f"segment-{i} not started again within {timeout_s} s"
        time.sleep(0.2)


def test_a_segment_declared_down_is_restarted_and_counted(tmp_path: Path) -> None:
    with Cluster(tmp_path / "run", f"bt{uuid.uuid4().hex[:6]}", segment_bytes=64 << 20) as cluster:
        assert cluster.segment_downs() == []
        mark = cluster.mark()
        starts = cluster.segment_starts(1)
        pid = int(cluster.state()["pids"]["segment-1"])
        os.kill(pid, signal.SIGSTOP)  # a segment that misses its heartbeats (a starved CPU)
        time.sleep(HEARTBEAT_TIMEOUT_S + 2.0)
        os.kill(pid, signal.SIGCONT)  # its next heartbeat is refused: it exits 75
        wait_started(cluster, 1, starts)
        seen = cluster.since(mark)
        assert seen["segment_down"] == 1
        assert seen["segment_down_events"][0]["segment_id"] == cluster.segment_ids[0]
        assert seen["segment_down_events"][0]["reason"] == "heartbeat_timeout"
        assert seen["segment_restarts"] == 1 and seen["segment_exit_codes"] == [75]
        assert int(cluster.state()["pids"]["segment-1"]) != pid

        mark = cluster.mark()
        events: list[tuple[float, str]] = []
        cluster.kill_segments(1.0, events, time.monotonic())  # (e)'s fault, both segments
        assert [what for _, what in events] == [
            "segments killed",
            "restart (supervisor resumed)",
            "segments up",
        ]
        seen = cluster.since(mark)
        assert seen["segment_restarts"] == 2 and seen["segment_exit_codes"] == [-9, -9]

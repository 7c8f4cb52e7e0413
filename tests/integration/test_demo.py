"""`make demo` (tools/demo.py) on a fresh run folder: brings the local cluster up, runs a small
shared-prefix workload through the HF adapter, prints the table with identical outputs and real
savings; `down` then leaves no process and no run file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.engines, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_demo_brings_the_cluster_up_and_prints_what_happened(tmp_path: Path) -> None:
    run = tmp_path / "run"
    demo = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "demo.py"),
            "--run-dir",
            str(run),
            "--requests",
            "3",
            "--prefix-tokens",
            "768",
            "--suffix-tokens",
            "64",
            "--new-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, COLUMNS="120"),
    )
    pids: list[int] = []
    try:
        state = json.loads((run / "cluster.json").read_text())
        pids = [int(p) for p in state.get("pids", {}).values() if p] + [int(state["supervisor_pid"])]
        assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
        out = demo.stdout
        assert "identical outputs" in out and "3/3" in out
        # Requests 2 and 3 load the shared 768-token prefix (3 chunks of 256) instead of computing it.
        assert "prefill tokens saved" in out and "1536" in out
        assert "fallbacks" in out and "none" in out
    finally:
        down = subprocess.run(
            [sys.executable, str(REPO / "tools" / "localcluster.py"), "down", "--run-dir", str(run)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert down.returncode == 0, down.stderr
    assert not run.exists()
    assert pids and not any(alive(p) for p in pids)

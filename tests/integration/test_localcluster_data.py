"""`make up` / `make down` keep what must outlive the processes in a data folder (issue 23): the
cluster secret, the auth plan (the tenants' share-domain salts) and each segment's disk tier file.
`down` removes the run folder and every process; a second `up` keeps the identity and reopens the
disk tiers instead of starting a new cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TOOL = Path(__file__).resolve().parents[2] / "tools" / "localcluster.py"
SSD_BYTES = 8 << 20


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)


def segment_started(run: Path) -> dict[str, object]:
    for line in (run / "logs" / "segment-1.log").read_text().splitlines():
        if '"segment_started"' in line:
            event: dict[str, object] = json.loads(line)
            return event
    raise AssertionError("segment-1 never logged segment_started")


def test_down_keeps_the_data_folder_and_up_reuses_it(tmp_path: Path) -> None:
    run, data, prefix = tmp_path / "run", tmp_path / "data", f"d{uuid.uuid4().hex[:6]}"
    common = ["--run-dir", str(run)]
    up = [
        "up",
        *common,
        "--data-dir",
        str(data),
        "--ssd-bytes",
        str(SSD_BYTES),
        "--segments",
        "1",
        "--segment-bytes",
        str(32 << 20),
        "--segment-prefix",
        prefix,
        "--nats-port",
        "0",
    ]
    try:
        first = tool(*up)
        assert first.returncode == 0, first.stderr
        assert "new secret" in first.stdout and "new auth plan" in first.stdout
        state = json.loads((run / "cluster.json").read_text())
        assert state["data_dir"] == str(data) and state["auth"]["dir"] == str(data / "auth")
        ssd = data / "ssd" / f"kvf-{prefix}-1.ssd"
        assert ssd.stat().st_size > SSD_BYTES and ssd.stat().st_mode & 0o777 == 0o600
        assert segment_started(run)["ssd_created"] is True
        secret = (data / "secret").read_text()
        salt = state["auth"]["tenants"]["demo"]["KVF_CLIENT_DOMAIN_SALT_HEX"]

        assert tool("down", *common).returncode == 0
        assert not run.exists()  # no run file left
        assert (data / "secret").read_text() == secret and ssd.exists()  # the data folder stays

        second = tool(*up)
        assert second.returncode == 0, second.stderr
        assert "secret kept" in second.stdout and "auth plan kept" in second.stdout
        state = json.loads((run / "cluster.json").read_text())
        assert state["auth"]["tenants"]["demo"]["KVF_CLIENT_DOMAIN_SALT_HEX"] == salt  # same share domain
        started = segment_started(run)
        assert started["ssd_created"] is False and started["ssd"] == str(ssd)  # reopened, not recreated
    finally:
        tool("down", *common)

"""`make up` / `make down` (tools/localcluster.py): a supervised local cluster comes up ready,
restarts a killed segment, and goes down leaving no process, run file or arena behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import nats
import nats.errors
import pytest

from kvfabric.proto import directory as m
from kvfabric.runtime.natsauth import nats_auth_from_env
from tests.integration.cluster import directory_call

pytestmark = pytest.mark.integration

TOOL = Path(__file__).resolve().parents[2] / "tools" / "localcluster.py"


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_up_supervises_and_down_leaves_nothing(tmp_path: Path) -> None:
    run, prefix = tmp_path / "run", f"t{uuid.uuid4().hex[:6]}"
    common = ["--run-dir", str(run)]
    started = tool(
        "up", *common, "--nats-port", "0", "--segment-bytes", str(64 << 20), "--segment-prefix", prefix
    )
    try:
        assert started.returncode == 0, started.stderr
        state = json.loads((run / "cluster.json").read_text())
        assert state["ready"] and set(state["pids"]) == {
            "nats",
            "directory",
            "segment-1",
            "segment-2",
            "segment-3",
            "eviction",
            "repair",
            "prefetch",
        }
        assert tool("up", *common).stdout.startswith("kvfabric is already up")
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):  # authenticated by default
            await nats.connect(state["nats_url"], allow_reconnect=False, connect_timeout=2)
        nc = await nats.connect(
            state["nats_url"], **nats_auth_from_env(state["auth"]["admin_env"]).connect_options()
        )
        try:
            segs = await directory_call(nc, "list_segments", m.ListSegments())
            assert isinstance(segs, m.SegmentList)
            assert {s.domain.zone for s in segs.segments if s.up} == {"zone-1", "zone-2", "zone-3"}
            (before,) = [s.incarnation for s in segs.segments if s.segment_id == f"{prefix}-2"]
            os.kill(state["pids"]["segment-2"], signal.SIGKILL)  # the supervisor brings it back

            async def restarted() -> int:
                while True:
                    segs = await directory_call(nc, "list_segments", m.ListSegments())
                    assert isinstance(segs, m.SegmentList)
                    for s in segs.segments:
                        if s.segment_id == f"{prefix}-2" and s.up and s.incarnation != before:
                            return s.incarnation
                    await asyncio.sleep(0.1)

            incarnation = await asyncio.wait_for(restarted(), 30.0)
            arenas = await asyncio.to_thread(lambda: sorted(Path("/dev/shm").glob(f"kvf-{prefix}-2-*")))
            # The restarted segment removed what its killed incarnation left (arena, slot board).
            live = f"kvf-{prefix}-2-{incarnation}"
            assert [a.name for a in arenas] == [live, live + ".slots"]
        finally:
            await nc.close()
        pids = list(json.loads(await asyncio.to_thread((run / "cluster.json").read_text))["pids"].values())
    finally:
        stopped = tool("down", *common)
    assert stopped.returncode == 0
    assert not run.exists()
    assert not [p for p in pids if alive(p)]
    assert not await asyncio.to_thread(lambda: list(Path("/dev/shm").glob(f"kvf-{prefix}-*")))

"""Issue 21 item 1: a directory whose lease lapses always comes back (docs/design.md: liveness).

Seen under a flood: the event loop was wedged past the 3 s leader lease, the lease lapsed, and
the directory hung in its stop — `DirectoryShell._publisher` cancelled but still running —
alive, leading nothing, never restarted. The publisher's cancellation was swallowed: Python
3.11's `asyncio.wait_for` (inside nats-py's request) returns the reply instead of raising when
the cancel and the reply land in the same loop iteration, which a flooded loop makes likely
(`tests/unit/runtime/test_stop_deadline.py` reproduces it with asyncio alone). Here that race is
made certain: the directory processes run with a `sitecustomize` that swallows the publisher's
first cancellation. The loop is wedged with SIGSTOP for longer than the lease; after SIGCONT the
instance must exit (so `tools/localcluster.py` restarts it) and a new one must serve."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient

from kvfabric.cluster.natsauth import nats_auth_from_env
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer
from tests.integration.cluster import directory_call, directory_process, segment_process

pytestmark = pytest.mark.integration

TOOL = Path(__file__).resolve().parents[2] / "tools" / "localcluster.py"
LEASE_TTL_MS = 1000
WEDGE_S = 2.5 * LEASE_TTL_MS / 1000
BACK_IN_SERVICE_S = 15.0  # wedge over + stop (bounded) + restart wait + a fresh start + rebuild

SWALLOW_FIRST_CANCEL = textwrap.dedent(
    """
    import asyncio, os

    if os.environ.get("KVF_INSTANCE_ID", "").startswith("directory"):
        from kvfabric.directory import shell

        original = shell.DirectoryShell._publisher

        async def publisher(self):
            try:
                await original(self)
            except asyncio.CancelledError:
                pass  # swallowed, as wait_for does when a reply lands with the cancel
            await original(self)  # and the loop runs on

        shell.DirectoryShell._publisher = publisher
    """
)


def tool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=180, env=env
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def state_of(run: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((run / "cluster.json").read_text())
    return state


async def test_a_wedged_directory_loses_its_lease_exits_and_is_back_in_service(tmp_path: Path) -> None:
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SWALLOW_FIRST_CANCEL)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(inject), os.environ.get("PYTHONPATH", "")) if p),
        KVF_DIRECTORY_LEADER_LEASE_TTL_MS=str(LEASE_TTL_MS),
    )
    run, prefix = tmp_path / "run", f"t{uuid.uuid4().hex[:6]}"
    common = ["--run-dir", str(run)]
    started = tool(
        "up", *common, "--nats-port", "0", "--segments", "1", "--segment-bytes", str(16 << 20),
        "--segment-prefix", prefix, env=env,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr
        state = state_of(run)
        nc = await nats.connect(
            state["nats_url"], **nats_auth_from_env(state["auth"]["admin_env"]).connect_options()
        )
        try:
            before = await directory_call(nc, "list_segments", m.ListSegments())
            assert isinstance(before, m.SegmentList) and before.epoch > 0
            # Read now, not at start: a 1 s lease may lapse once while a loaded host starts the
            # cluster (a restart before the wedge; that exit is not the one this test is about).
            wedged = state_of(run)["pids"]["directory"]
            exits_before = len(child_exits(run))
            os.kill(wedged, signal.SIGSTOP)  # the loop runs nothing: the lease lapses meanwhile
            await asyncio.sleep(WEDGE_S)
            os.kill(wedged, signal.SIGCONT)
            resumed_s = time.monotonic()

            async def back_in_service() -> m.SegmentList:
                while True:
                    try:
                        listed = await directory_call(nc, "list_segments", m.ListSegments())
                    except Exception:  # no leader yet (wrong_shard, unavailable, timeout)
                        listed = None
                    pid = state_of(run)["pids"]["directory"]
                    if isinstance(listed, m.SegmentList) and listed.epoch > before.epoch and pid != wedged:
                        return listed
                    await asyncio.sleep(0.1)

            try:
                after = await asyncio.wait_for(back_in_service(), BACK_IN_SERVICE_S)
            except TimeoutError:
                still = "still alive (hung in its stop)" if alive(wedged) else "gone"
                pytest.fail(
                    f"no directory in service {BACK_IN_SERVICE_S} s after SIGCONT; the wedged one is {still}"
                )
            took_s = time.monotonic() - resumed_s
            assert [s.segment_id for s in after.segments if s.up] == [f"{prefix}-1"]
        finally:
            await nc.close()
        assert not alive(wedged)
        exits = child_exits(run)[exits_before:]
        assert [(e["child"], e["exit_code"]) for e in exits] == [("directory", 75)]  # lease lost
        print(f"back in service {took_s:.1f} s after the wedge ended")
    finally:
        assert tool("down", *common).returncode == 0


def child_exits(run: Path) -> list[dict[str, object]]:
    """The supervisor's `child_exited` records so far, oldest first."""
    log = run / "logs" / "supervisor.log"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if '"child_exited"' in line]


def test_a_directory_that_cannot_reach_nats_at_start_exits_to_be_restarted() -> None:
    """NATS unreachable at start (or the credentials refused): the directory's own connection
    reconnects without end once connected, but its first connect is bounded as the runtime's
    is (attempts × wait + a connect timeout), then it exits 69 for its supervisor to restart it
    (review, 2026-12-05: it retried forever, alive and serving nothing, a traceback a retry)."""
    from kvfabric.runtime import EXIT_UNAVAILABLE
    from kvfabric.testing import ServiceProcess
    from kvfabric.testing.cluster import service_env
    from kvfabric.testing.ports import free_port

    env = service_env(
        KVF_NATS_RECONNECT_ATTEMPTS_MAX="5",
        KVF_NATS_RECONNECT_WAIT_MS="100",
        KVF_NATS_CONNECT_TIMEOUT_MS="500",
    )
    proc = ServiceProcess.python_module(
        "kvfabric.directory", "--nats-url", f"nats://127.0.0.1:{free_port()}", "--log-json", env=env
    )
    proc.start()
    try:
        assert proc.wait(20.0) == EXIT_UNAVAILABLE
        failed = proc.wait_for_event("directory_start_failed", 1.0)
        assert "TimeoutError" in failed["error"]
    finally:
        proc.stop(timeout_s=5.0)


async def test_a_leader_whose_loop_stalls_past_the_heartbeat_timeout_keeps_its_segments(
    nats_server: NatsServer, nats_client: NatsClient
) -> None:
    """A leader whose event loop stalls for longer than the segments' heartbeat timeout but less
    than its lease (on a NATS cluster: 5-12.5 s) heard no heartbeat meanwhile; its first tick
    after the stall declared every segment down, and each restarted empty at its next heartbeat
    (`not_found`): the whole cache lost for the directory's own stall. The stall (SIGSTOP here)
    is now excused as a disconnect is (docs/directory-ha.md, "A leader that cannot hear")."""
    env = {"KVF_DIRECTORY_LEADER_LEASE_TTL_MS": "30000", "KVF_DIRECTORY_HEARTBEAT_TIMEOUT_MS": "2000"}
    with directory_process(nats_server, **env) as directory, segment_process(nats_server, "seg-stall"):

        async def the_segment() -> m.SegmentInfo:
            listed = await directory_call(nats_client, "list_segments", m.ListSegments())
            assert isinstance(listed, m.SegmentList)
            (segment,) = listed.segments
            return segment

        before = await the_segment()
        assert before.up
        directory.send_signal(signal.SIGSTOP)  # the loop runs nothing; the segment heartbeats on
        try:
            await asyncio.sleep(5.0)
        finally:
            directory.send_signal(signal.SIGCONT)
        directory.wait_for_event("tick_after_loop_stall", 10.0)
        await asyncio.sleep(3.0)  # heartbeats after the stall; a segment declared down restarts here
        after = await the_segment()
        assert after.up and after.incarnation == before.incarnation

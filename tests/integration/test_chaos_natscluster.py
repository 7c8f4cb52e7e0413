"""The 3-node NATS cluster of the nats-node-kill drill (tools/chaos_natscluster.py) without the
rest of a cluster: nodes 2 and 3 from `prepare`, node 1 started here with the config `prepare`
wrote for localcluster's nats-server. JetStream takes an R3 stream, a killed node comes back on
its store, and close() leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import nats
import pytest
from nats.js.api import StreamConfig

from tests.unit.tools.toolkit import load_tool

pytestmark = [pytest.mark.timeout(90)]

nc_mod = load_tool("chaos_natscluster")
lc = load_tool("localcluster")


async def r3_stream_works(url: str, user_env: dict[str, str]) -> int:
    from kvfabric.cluster.natsauth import nats_auth_from_env

    nc = await nats.connect(url, **nats_auth_from_env(user_env).connect_options())
    try:
        js = nc.jetstream(timeout=5.0)
        for _ in range(50):  # the cluster may still be electing its meta leader
            try:
                await js.add_stream(StreamConfig(name="CHAOS_R3", subjects=["chaos.r3"], num_replicas=3))
                break
            except Exception:
                await asyncio.sleep(0.2)
        for _ in range(50):
            try:
                await js.publish("chaos.r3", b"x", timeout=2.0)
                break
            except Exception:
                await asyncio.sleep(0.2)
        info = await js.stream_info("CHAOS_R3")
        return 1 + len(info.cluster.replicas or []) if info.cluster else 1
    finally:
        await nc.close()


def test_three_nodes_form_a_jetstream_cluster_survive_a_kill_and_leave_nothing() -> None:
    run = Path(tempfile.mkdtemp(prefix="kvf-chaos-natscluster-test-"))
    cluster = nc_mod.NatsCluster()
    node1 = None
    try:
        cluster.prepare(run, {"nats_cluster": 3})
        data = lc.default_data_dir(run)
        auth = lc.read_auth(data)
        port = lc.free_port()
        node1 = subprocess.Popen(  # what localcluster's supervisor runs as node 1
            [
                lc.nats_server_binary(),
                "-js",
                "-sd",
                str(run / "nats"),
                "-a",
                "127.0.0.1",
                "-p",
                str(port),
                "-c",
                auth["conf"],
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        admin = auth["users"]["admin"]["env"]
        assert asyncio.run(r3_stream_works(f"nats://127.0.0.1:{port}", admin)) == 3
        assert cluster.fire({"action": "kill", "target": "nats-2"}).startswith("kill nats-2")
        assert asyncio.run(r3_stream_works(cluster.url(3), admin)) == 3  # 2 of 3: still a quorum
        assert cluster.fire({"action": "restart", "target": "nats-2"}).startswith("restart nats-2")
        with pytest.raises(ValueError, match="no nats node"):
            cluster.fire({"action": "kill", "target": "nats-7"})
        pids = [p.pid for p in cluster.procs.values()]
    finally:
        left = cluster.close()
        if node1 is not None:
            node1.terminate()
            node1.wait(10)
        shutil.rmtree(run, ignore_errors=True)
    assert left == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

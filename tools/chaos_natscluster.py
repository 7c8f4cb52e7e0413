"""A 3-node NATS cluster under a drill's local cluster, for `make chaos` (issue 27).

    [topology]
    nats_cluster = 3            # nodes; JetStream R3 (KVF_DIRECTORY_KV_REPLICAS=3)
    extra = [{ kind = "directory", nats_node = 2 }, { kind = "directory", nats_node = 3 }]

tools/localcluster.py starts one nats-server (node 1, supervised, restarted when it dies) with
the config of the cluster's auth plan. Before `up`, `NatsCluster.prepare` writes that plan into
the run's data folder (`localcluster.ensure_identity`, which `up` then keeps), adds a `cluster`
block and a server name to node 1's config, and starts nodes 2 and 3 itself (same users and
permissions, their own client and route ports, their own store folders `<run>/nats-<i>`), so
node 1 joins them as it starts and JetStream has its quorum from the first stream on. Every
supervised service connects to node 1 and learns the others from it (nats-py reconnects to any
node it heard of); `extra` directory instances (tools/chaos_skew.py) connect to node 2 or 3.

Faults `kill` / `restart` with target `nats-2` or `nats-3` SIGKILL that node or start it again
(same store: it catches up from its peers); `kill` of `nats` is node 1 (the supervisor restarts
it). `stream_leader` (`stream`, `node`) moves a stream's leader to that node first (JetStream's
leader stepdown with a preferred server), so that a kill hits the worst case on purpose: e.g.
the leaders bucket `KV_KVF_DIRECTORY_LEADERS`, whose leases then wait out a 4-9 s election.
`close()` (the runner's `finally`, before `down`) stops nodes 2 and 3 and returns what is
left (must be nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent))

import localcluster  # type: ignore[import-not-found]

__all__ = ["NatsCluster"]

READY_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 10.0
POLL_S: Final = 0.1
CLUSTER_NAME: Final = "kvf-chaos"
LEADER_MOVE_TIMEOUT_S: Final = 15.0


def free_port() -> int:
    port: int = localcluster.free_port()
    return port


def cluster_block(node: int, cluster_ports: list[int]) -> str:
    routes = ", ".join(f"nats-route://127.0.0.1:{p}" for i, p in enumerate(cluster_ports, 1) if i != node)
    return (
        f"\n# chaos: node {node} of a {len(cluster_ports)}-node cluster (tools/chaos_natscluster.py)\n"
        f"server_name: kvf-n{node}\n"
        f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: 127.0.0.1:{cluster_ports[node - 1]}\n"
        f"  routes: [{routes}]\n}}\n"
    )


class NatsCluster:
    """Nodes 2..N of a drill's NATS cluster (module docstring)."""

    def __init__(self) -> None:
        self.nodes = 1
        self.run: Path | None = None
        self.client_ports: dict[int, int] = {}
        self.argv: dict[int, list[str]] = {}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def env(self, topo: dict[str, Any]) -> dict[str, str]:
        """What the cluster's services need to know (JetStream replicas)."""
        nodes = int(topo.get("nats_cluster", 1))
        return {"KVF_DIRECTORY_KV_REPLICAS": str(nodes)} if nodes > 1 else {}

    def prepare(self, run: Path, topo: dict[str, Any]) -> None:
        self.nodes = int(topo.get("nats_cluster", 1))
        if self.nodes <= 1:
            return
        if int(topo.get("netns_segments", 0)):
            raise ValueError("nats_cluster with netns_segments is not supported (routes on loopback)")
        self.run = run
        data = localcluster.default_data_dir(run)
        localcluster.ensure_identity(data, True, False, ["demo"])  # `up` keeps it (same tenants)
        conf = Path(localcluster.read_auth(data)["conf"])
        base = conf.read_text()
        cluster_ports = [free_port() for _ in range(self.nodes)]
        conf.write_text(base + cluster_block(1, cluster_ports))  # node 1: localcluster's nats-server
        (run / "logs").mkdir(parents=True, exist_ok=True)
        for node in range(2, self.nodes + 1):
            node_conf = conf.with_name(f"nats-node-{node}.conf")
            node_conf.touch(mode=0o600)
            node_conf.write_text(base + cluster_block(node, cluster_ports))
            self.client_ports[node] = free_port()
            self.argv[node] = [
                localcluster.nats_server_binary(),
                "-js",
                "-sd",
                str(run / f"nats-{node}"),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.client_ports[node]),
                "-c",
                str(node_conf),
            ]
            self._start(node)
        for node in self.procs:
            self._wait_ready(node)

    def url(self, node: int) -> str:
        return f"nats://127.0.0.1:{self.client_ports[node]}"

    def _start(self, node: int) -> None:
        assert self.run is not None
        with (self.run / "logs" / f"nats-{node}.log").open("ab") as log:
            self.procs[node] = subprocess.Popen(
                self.argv[node], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def _wait_ready(self, node: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.procs[node].poll() is not None:
                raise RuntimeError(
                    f"nats node {node} exited {self.procs[node].returncode} (logs/nats-{node}.log)"
                )
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.client_ports[node]), 1),
            ):
                return
            time.sleep(POLL_S)
        raise RuntimeError(f"nats node {node} did not listen within {READY_TIMEOUT_S} s")

    def fire(self, fault: dict[str, Any]) -> str:
        node = int(str(fault.get("target", "")).removeprefix("nats-"))
        if node not in self.argv:
            raise ValueError(f"no nats node {fault.get('target')!r} in this drill (nats_cluster)")
        proc = self.procs.get(node)
        if fault["action"] == "kill":
            if proc is None or proc.poll() is not None:
                return f"kill nats-{node}: already gone"
            proc.send_signal(signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)
            return f"kill nats-{node} (pid {proc.pid})"
        if proc is not None and proc.poll() is None:
            return f"restart nats-{node}: still running"
        self._start(node)
        self._wait_ready(node)
        return f"restart nats-{node} (pid {self.procs[node].pid})"

    def move_leader(self, nats_url: str, auth_env: dict[str, str], fault: dict[str, Any]) -> str:
        """`stream_leader`: make node `fault["node"]` lead `fault["stream"]` (admin credentials)."""
        import nats

        from kvfabric.cluster.natsauth import nats_auth_from_env

        stream, node = str(fault["stream"]), int(fault["node"])
        wanted = f"kvf-n{node}"

        async def move() -> str:
            nc = await nats.connect(nats_url, **nats_auth_from_env(auth_env).connect_options())
            try:
                js = nc.jetstream(timeout=5.0)
                started = time.monotonic()
                before = (await js.stream_info(stream)).cluster
                was = before.leader if before is not None else None
                while time.monotonic() - started < LEADER_MOVE_TIMEOUT_S:
                    info = (await js.stream_info(stream)).cluster
                    if info is not None and info.leader == wanted:
                        return (
                            f"stream_leader {stream}: {was} -> {wanted} ({time.monotonic() - started:.1f} s)"
                        )
                    if info is not None and info.leader:
                        body = json.dumps({"placement": {"preferred": wanted}}).encode()
                        with contextlib.suppress(Exception):  # asked again until it shows
                            await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", body, timeout=5.0)
                    await asyncio.sleep(0.5)
                raise RuntimeError(f"{stream} still led by {was}, not {wanted}")
            finally:
                await nc.close()

        return asyncio.run(move())

    def close(self) -> list[str]:
        left = []
        for node, proc in self.procs.items():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(STOP_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, 0)
                left.append(f"process nats-{node} (pid {proc.pid})")
        self.procs.clear()
        return left

"""Three (or more) clustered `nats-server`s with JetStream, for tests that need a NATS cluster.

Each node is a `NatsServer` with its own store dir, client, monitor and cluster ports, a unique
server name, and routes to every node (`--cluster_name kvf`). JetStream assets created with
`replicas=3` survive one node. `url` lists every node, so a client fails over between them;
`urls[i]` pins a process to node i.

Owns: the node processes (stopped by `stop`, or by `start` itself when it fails). The store dir
belongs to the caller.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Final

from kvfabric.testing.nats_server import NatsServer, NatsServerError
from kvfabric.testing.ports import free_ports

__all__ = ["NatsCluster"]

CLUSTER_NAME: Final = "kvf"
META_TIMEOUT_S: Final = 20.0


class NatsCluster:
    def __init__(self, store_dir: Path, size: int = 3, host: str = "127.0.0.1") -> None:
        if size < 3:
            raise ValueError("a JetStream cluster needs at least 3 nodes")
        cluster_ports = free_ports(size, host)  # distinct (free_port twice may repeat one)
        routes = ",".join(f"nats://{host}:{p}" for p in cluster_ports)
        self.nodes = [
            NatsServer(
                Path(store_dir) / f"n{i}",
                host=host,
                extra_args=(
                    "-n",
                    f"kvf-n{i}",
                    "--cluster_name",
                    CLUSTER_NAME,
                    "--cluster",
                    f"nats://{host}:{cluster_ports[i]}",
                    "--routes",
                    routes,
                ),
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (nats-py and the services accept a server list)."""
        return ",".join(self.urls)

    def start(self) -> NatsCluster:
        """Start every node and wait for the meta leader; a start that fails part-way (a node
        that will not start, no leader in time, an interrupt) stops the nodes it started."""
        try:
            for node in self.nodes:
                node.start()
            self.wait_meta_leader(META_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_meta_leader(self, timeout_s: float) -> None:
        """Until JetStream's meta group has a leader and every node sees the whole cluster."""
        deadline = time.monotonic() + timeout_s
        while not self._meta_formed():
            if time.monotonic() > deadline:
                raise NatsServerError(f"no JetStream meta leader after {timeout_s} s")
            time.sleep(0.1)

    def _meta_formed(self) -> bool:
        """Whether every node reports a meta leader over the full cluster (False while a node's
        monitor port does not answer yet)."""
        for node in self.nodes:
            try:
                with urllib.request.urlopen(f"{node.monitor_url}/jsz", timeout=1.0) as response:
                    meta = json.loads(response.read()).get("meta_cluster") or {}
            except OSError:
                return False
            if not (meta.get("leader") and meta.get("cluster_size") == len(self.nodes)):
                return False
        return True

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

"""Test harness: a real `nats-server` on free ports, service subprocesses, pytest fixtures.

- `NatsServer`: one nats-server process with JetStream, its own store dir and free ports;
  `stop()` / `kill()` / `restart()` (same ports and store dir, so JetStream data survives).
- `NatsCluster`: three clustered nats-servers (JetStream R3 possible), `url` lists every node.
- `ServiceProcess`: a service started as a subprocess, its JSON log lines parsed as they come.
- `free_port()`: a TCP port on 127.0.0.1 that was free a moment ago.
- probes: `micro_control` (`$SRV.PING/INFO/STATS`), `scrape_metrics`, `metric_value`, `wait_until`.
- `kvfabric.testing.pytest_plugin`: fixtures `nats_server` and `nats_client`.
- `kvfabric.testing.vllmkit` / `vllm_run`: fresh vLLM engine processes over a plan of prompts;
  `kvfabric.testing.sglangkit`: SGLang's own HiCache classes driving the backend (not imported
  here: they need vLLM / torch and SGLang).
"""

from kvfabric.testing.nats_cluster import NatsCluster
from kvfabric.testing.nats_server import NatsServer, NatsServerError, find_nats_server
from kvfabric.testing.ports import free_port
from kvfabric.testing.probes import (
    metric_value,
    micro_control,
    scrape_metrics,
    scrape_metrics_async,
    wait_until,
)
from kvfabric.testing.process import ServiceProcess, ServiceProcessError

__all__ = [
    "NatsCluster",
    "NatsServer",
    "NatsServerError",
    "ServiceProcess",
    "ServiceProcessError",
    "find_nats_server",
    "free_port",
    "metric_value",
    "micro_control",
    "scrape_metrics",
    "scrape_metrics_async",
    "wait_until",
]

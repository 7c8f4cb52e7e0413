"""A segment started before any directory instance leads a shard waits for one and registers
(before: `segment_start_failed` 0.7 s after start, exit 69, seen in a fresh clone's CI run on a
busy machine when the directory answered the shard map late)."""

from __future__ import annotations

import time

from kvfabric.testing import NatsServer
from kvfabric.testing.cluster import directory_process, service_env
from kvfabric.testing.process import ServiceProcess


def test_a_segment_started_first_registers_once_a_directory_leads(nats_server: NatsServer) -> None:
    segment = ServiceProcess.python_module(
        "kvfabric.segment_storage",
        "--nats-url",
        nats_server.url,
        "--metrics-port",
        "0",
        "--log-json",
        env=service_env(KVF_SEGMENT_ID=f"first-{time.monotonic_ns()}", KVF_SEGMENT_BYTES=str(16 << 20)),
    )
    segment.start()
    try:
        segment.wait_for_event("register_retry", 20.0)  # no directory yet: it waits
        with directory_process(nats_server):
            segment.wait_for_event("segment_started", 30.0)
    finally:
        segment.stop(timeout_s=10.0)

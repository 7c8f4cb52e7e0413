"""A segment started before any directory instance leads a shard waits for one and registers
(before: `segment_start_failed` 0.7 s after start, exit 69, seen in a fresh clone's CI run on a
busy machine when the directory answered the shard map late). It runs with the arena prefault on (off in
the other tests, tests/conftest.py): the arena file holds every page once it logs so."""

from __future__ import annotations

import time
from pathlib import Path

from kvfabric.testing import NatsServer
from kvfabric.testing.cluster import directory_process, service_env
from kvfabric.testing.process import ServiceProcess

ARENA_BYTES = 16 << 20


def test_a_segment_started_first_registers_once_a_directory_leads(nats_server: NatsServer) -> None:
    segment_id = f"first-{time.monotonic_ns()}"
    segment = ServiceProcess.python_module(
        "kvfabric.segment_storage",
        "--nats-url",
        nats_server.url,
        "--metrics-port",
        "0",
        "--log-json",
        env=service_env(
            KVF_SEGMENT_ID=segment_id, KVF_SEGMENT_BYTES=str(ARENA_BYTES), KVF_SEGMENT_ARENA_PREFAULT="1"
        ),
    )
    segment.start()
    try:
        segment.wait_for_event("register_retry", 20.0)  # no directory yet: it waits
        with directory_process(nats_server):
            started = segment.wait_for_event("segment_started", 30.0)
        segment.wait_for_event("arena_prefaulted", 30.0)
        assert Path(started["arena"]).stat().st_blocks * 512 >= ARENA_BYTES
    finally:
        segment.stop(timeout_s=10.0)

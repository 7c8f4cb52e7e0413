"""One process per segment id and host: a second segment started with a live one's id (a
misconfiguration) is refused before it touches any file. Before, its start removed the live
segment's arena and slot board as 'stale', and local readers lost the arena."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from kvfabric.testing import NatsServer, ServiceProcess
from tests.integration.cluster import directory_process, run_shm_dir, segment_process, service_env

pytestmark = pytest.mark.integration

SEGMENT_ID = "seg-dup"
EXIT_USAGE = 2


def test_a_second_process_with_the_same_segment_id_is_refused(nats_server: NatsServer) -> None:
    shm = run_shm_dir()  # where this run's segments keep their files (KVF_SEGMENT_SHM_DIR)
    with contextlib.ExitStack() as stack:
        stack.enter_context(directory_process(nats_server))
        first = stack.enter_context(segment_process(nats_server, SEGMENT_ID, arena_bytes=8 << 20))
        arena = Path(first.wait_for_event("segment_started", 1.0)["arena"])
        files = sorted(p.name for p in shm.glob(f"kvf-{SEGMENT_ID}[-.]*"))
        assert files == sorted([arena.name, arena.name + ".slots", f"kvf-{SEGMENT_ID}.lock"])

        second = ServiceProcess.python_module(
            "kvfabric.segment_storage",
            "--nats-url",
            nats_server.url,
            "--metrics-port",
            "0",
            "--log-json",
            env=service_env(KVF_SEGMENT_ID=SEGMENT_ID, KVF_SEGMENT_BYTES=str(8 << 20)),
        )
        second.start()
        try:
            assert second.wait(20.0) == EXIT_USAGE
            refused = second.wait_for_event("segment_id_in_use", 1.0)
            assert SEGMENT_ID in refused["error"]
        finally:
            second.stop(timeout_s=5.0)
        assert sorted(p.name for p in shm.glob(f"kvf-{SEGMENT_ID}[-.]*")) == files  # untouched
        assert first.returncode is None

        first.stop(timeout_s=10.0)
        assert first.returncode == 0
        assert list(shm.glob(f"kvf-{SEGMENT_ID}[-.]*")) == []  # a clean stop leaves no file

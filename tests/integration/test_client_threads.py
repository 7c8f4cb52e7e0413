"""A client created from a pinned engine thread (vLLM's compute thread is bound by OpenMP) keeps
its save threads off that thread's CPUs with `thread_cpus="auto"` and lets its loop and transfer
threads (loads, which the engine thread waits for) run on every CPU of the parent process (issue
20, item 7); by default they all inherit the pin."""

from __future__ import annotations

import os
import threading

import pytest

from kvfabric.client import ClientSettings, KvClient
from kvfabric.testing import NatsServer
from tests.integration.clientkit import SPEC

pytestmark = pytest.mark.integration


def test_client_threads_run_off_the_pinned_creators_cpu(nats_server: NatsServer) -> None:
    parent = frozenset(os.sched_getaffinity(os.getppid()))
    pin = min(parent)
    seen: dict[str, dict[str, frozenset[int]]] = {}

    def affinity() -> frozenset[int]:
        return frozenset(os.sched_getaffinity(0))

    def engine_thread() -> None:
        os.sched_setaffinity(0, {pin})
        for mode in ("auto", ""):
            with KvClient(ClientSettings(nats_url=nats_server.url, thread_cpus=mode), SPEC) as client:
                assert client.enabled
                tid = client._thread.native_id
                assert tid is not None
                seen[mode] = {
                    "loop": frozenset(os.sched_getaffinity(tid)),
                    # executor threads are started lazily, from whichever thread submits first
                    "transfer": client.aio._executor.submit(affinity).result(10),
                    "save": client.aio._save_executor.submit(affinity).result(10),
                }

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join(60)
    off = (parent - {pin}) or {pin}  # a 1-CPU machine has nowhere else
    anywhere = parent if len(parent) > 1 else {pin}
    assert seen["auto"] == {"loop": anywhere, "transfer": anywhere, "save": off}
    assert seen[""] == {"loop": {pin}, "transfer": {pin}, "save": {pin}}

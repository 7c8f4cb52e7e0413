"""A local cluster for integration tests: directory + segments as subprocesses on the test's NATS."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import msgspec
from nats.aio.client import Client as NatsClient

from kvfabric.proto import directory as m
from kvfabric.proto.dataplane import ReadRef
from kvfabric.proto.segment import DrainRequest, SegmentState, segment_decoder
from kvfabric.proto.subjects import Service, endpoint_subject, segment_subject
from kvfabric.proto.tickets import read_token
from kvfabric.runtime import request
from kvfabric.testing import NatsServer, ServiceProcess

SECRET = "integration-cluster-secret-0123"
TIMEOUT_S = 10.0


def service_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, KVF_CLUSTER_SECRET=SECRET, **extra)


@contextmanager
def service_process(nats: NatsServer, module: str, ready_event: str, **env: str) -> Iterator[ServiceProcess]:
    """`python -m <module>` on the test's NATS with JSON logs, ready once it logs `ready_event`;
    stopped (SIGTERM, then SIGKILL) afterwards."""
    proc = ServiceProcess.python_module(
        module, "--nats-url", nats.url, "--metrics-port", "0", "--log-json", env=service_env(**env)
    )
    proc.start()
    try:
        proc.wait_for_event(ready_event, 20.0)
        yield proc
    finally:
        proc.stop(timeout_s=10.0)


def directory_process(
    nats: NatsServer, ready_event: str = "directory_started", **env: str
) -> AbstractContextManager[ServiceProcess]:
    """A directory instance; `ready_event="directory_standby"` for one that will wait as a standby."""
    return service_process(nats, "kvfabric.directory", ready_event, **env)


@contextmanager
def segment_process(
    nats: NatsServer, segment_id: str, arena_bytes: int = 256 << 20, **env: str
) -> Iterator[ServiceProcess]:
    try:
        with service_process(
            nats,
            "kvfabric.segment_storage",
            "segment_started",
            KVF_SEGMENT_ID=segment_id,
            KVF_SEGMENT_BYTES=str(arena_bytes),
            **env,
        ) as proc:
            yield proc
    finally:
        for leftover in glob.glob(f"/dev/shm/kvf-{segment_id}-*"):  # only after a SIGKILL
            os.unlink(leftover)


def eviction_process(nats: NatsServer, **env: str) -> AbstractContextManager[ServiceProcess]:
    return service_process(nats, "kvfabric.eviction_policy", "eviction_started", **env)


def repair_process(nats: NatsServer, **env: str) -> AbstractContextManager[ServiceProcess]:
    return service_process(nats, "kvfabric.repair", "repair_started", **env)


def prefetch_process(nats: NatsServer, **env: str) -> AbstractContextManager[ServiceProcess]:
    return service_process(nats, "kvfabric.prefetch", "prefetch_started", **env)


def signed_ref(
    segment_id: str, incarnation: int, slot: int, generation: int, size: int, ttl_ms: int = 60_000
) -> ReadRef:
    """A read reference with a read token signed like the directory signs them (tests know the
    cluster secret): for data-plane tests that build references themselves."""
    expires = time.time_ns() // 1_000_000 + ttl_ms
    token = read_token(SECRET.encode(), segment_id, incarnation, slot, generation, size, expires)
    return ReadRef(incarnation, slot, generation, size, token, expires)


async def directory_call(nc: NatsClient, verb: str, message: msgspec.Struct) -> msgspec.Struct:
    reply = await request(nc, endpoint_subject(Service.DIRECTORY, verb), message, m.reply_decoder, TIMEOUT_S)
    assert isinstance(reply, msgspec.Struct)
    return reply


async def segment_state(nc: NatsClient, segment_id: str, draining: bool = False) -> SegmentState:
    reply = await request(
        nc, segment_subject(segment_id, "drain"), DrainRequest(draining=draining), segment_decoder, TIMEOUT_S
    )
    assert isinstance(reply, SegmentState)
    return reply

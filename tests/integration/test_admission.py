"""Live admission at put_begin (issue 25 item 4) on a local cluster: a chunk the admission
filter refuses is not written and is counted by the client, later chunks of its prompt are not
written either, and once filters stop arriving (the policy stopped) puts are admitted again
after the staleness bound. The eviction policy publishes filters the directory installs."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Iterator

import msgspec
import nats
import pytest

from kvfabric.client import ClientSettings, KvClient
from kvfabric.format.clock import now_ms
from kvfabric.format.key import ShareDomain
from kvfabric.proto import directory as m
from kvfabric.proto import eviction as e
from kvfabric.proto.codec import encode
from kvfabric.proto.subjects import Service, endpoint_subject
from kvfabric.testing import NatsServer, ServiceProcess, metric_value, scrape_metrics_async
from tests.integration.clientkit import CHUNK_BYTES, SPEC, TOKENS_PER_CHUNK, client, objects_for, prompt
from tests.integration.cluster import (
    directory_call,
    directory_process,
    eviction_process,
    next_admission_filter,
    segment_process,
)

pytestmark = pytest.mark.integration

SEGMENT = f"seg-adm-{os.getpid()}"  # an id of its own (locks are per id and folder: run_shm_dir)
STALE_MS = 4_000  # the window a test has to use a filter once installed (a loaded host is slow)
SUBJECT = endpoint_subject(Service.EVICTION, e.ADMISSION_FILTER_VERB)
U = e.ADMISSION_UNLIMITED


@pytest.fixture
def directory(nats_server: NatsServer) -> Iterator[ServiceProcess]:
    with (
        directory_process(nats_server, KVF_DIRECTORY_ADMISSION_STALE_MS=str(STALE_MS)) as proc,
        segment_process(nats_server, SEGMENT, arena_bytes=16 << 20),
    ):
        yield proc


async def publish(url: str, message: e.AdmissionFilter) -> None:
    nc = await nats.connect(url)
    try:
        await nc.publish(SUBJECT, encode(message))
        await nc.flush()
    finally:
        await nc.close()


def refusing(limits: list[int]) -> e.AdmissionFilter:
    return e.AdmissionFilter(
        generated_ms=now_ms(),
        events_seq=0,
        policy="test",
        pools=[e.PoolAdmission(segment_id=SEGMENT, group_bytes_max=limits)],
    )


async def published_chunks(url: str) -> set[int]:
    nc = await nats.connect(url)
    try:
        reply = await directory_call(nc, "list_groups", m.ListGroups(limit=1000))
        assert isinstance(reply, m.GroupList)
        return {g.chunk_index for g in reply.groups}
    finally:
        await nc.close()


def wait_filter_installed(directory: ServiceProcess, timeout_s: float = 5.0) -> None:
    """Until the directory has installed a filter from its own subscription (a fixed sleep was
    short on a loaded host: the save then came before the filter)."""
    port = directory.wait_for_event("directory_started", 1.0)["metrics_port"]
    deadline = time.monotonic() + timeout_s
    while True:
        text = asyncio.run(scrape_metrics_async(port))
        if (metric_value(text, "kvfabric_directory_admission_filters_received_total") or 0) >= 1:
            return
        assert time.monotonic() < deadline, "the directory installed no admission filter"
        time.sleep(0.05)


async def core_event(directory: ServiceProcess, name: str) -> float:
    port = directory.wait_for_event("directory_started", 1.0)["metrics_port"]
    text = await scrape_metrics_async(port)
    return metric_value(text, "kvfabric_directory_core_events_total", name=name) or 0.0


def not_admitted(kv: KvClient) -> float:
    value = kv.metrics.registry.get_sample_value(
        "kvfabric_client_save_failures_total", {"cause": "not_admitted"}
    )
    return value or 0.0


def test_a_refused_chunk_is_not_written_counted_and_admitted_once_the_filter_is_stale(
    nats_server: NatsServer, directory: ServiceProcess
) -> None:
    tokens = prompt(4 * TOKENS_PER_CHUNK, seed=4242)
    # Chunk c has length class bit_length(c + 1): 0 -> 1, 1 -> 2, 2 -> 2, 3 -> 3. Class 2 is
    # refused at any size: chunks 1 and 2 are not_admitted, chunk 3 is placed but, past a
    # refused chunk, not written by the client (no prefix hit could reach it).
    limits = [U, U, 0, U, U, U, U, U]
    with client(nats_server) as kv:
        asyncio.run(publish(nats_server.url, refusing(limits)))
        wait_filter_installed(directory)
        result = kv.save(tokens, objects_for(tokens, 0, 4))
        assert (result.chunks_saved, result.chunks_failed) == (1, 3), result
        assert result.causes == {"not_admitted": 3}
        assert result.bytes_written == CHUNK_BYTES  # chunk 0's bytes only: nothing else moved
        assert not_admitted(kv) == 3
        assert asyncio.run(published_chunks(nats_server.url)) == {0}
        hit = kv.lookup(tokens)
        assert hit.chunks == 1  # the engine recomputes chunks 1-3, as on a miss
        kv.release(hit)
        assert asyncio.run(core_event(directory, "admission_refused_below_frontier")) == 2
        # The policy stops publishing: past the staleness bound the same chunks are admitted.
        time.sleep(STALE_MS / 1000 + 0.5)
        again = kv.save(tokens, objects_for(tokens, 0, 4))
        assert (again.chunks_saved, again.chunks_existing, again.chunks_failed) == (3, 1, 0), again
        assert asyncio.run(core_event(directory, "admission_admitted_stale")) >= 3
        hit = kv.lookup(tokens)
        assert hit.chunks == 4
        kv.release(hit)


def test_a_protected_share_domain_is_admitted_where_the_filter_refuses_another(
    nats_server: NatsServer, directory: ServiceProcess
) -> None:
    """A domain below its guaranteed share is listed as protected (issue 25 item 5): the gate
    admits all its chunks where the same filter refuses another domain's."""
    other = dataclasses.replace(SPEC, domain=ShareDomain(tenant_id="tenant-b", salt=SPEC.domain.salt))
    filt = msgspec.structs.replace(
        refusing([U, U, 0, U, U, U, U, U]), protected_domains=[SPEC.domain.digest()]
    )
    with client(nats_server) as kv, KvClient(ClientSettings(nats_url=nats_server.url), other) as kv_b:
        asyncio.run(publish(nats_server.url, filt))
        wait_filter_installed(directory)
        tokens = prompt(4 * TOKENS_PER_CHUNK, seed=4545)
        protected = kv.save(tokens, objects_for(tokens, 0, 4))
        assert (protected.chunks_saved, protected.chunks_failed) == (4, 0), protected
        refused = kv_b.save(tokens, objects_for(tokens, 0, 4))
        assert (refused.chunks_saved, refused.causes) == (1, {"not_admitted": 3}), refused
    assert asyncio.run(core_event(directory, "admission_admitted_guaranteed")) == 4


def test_the_policy_publishes_filters_and_puts_are_admitted_once_it_stops(
    nats_server: NatsServer, directory: ServiceProcess
) -> None:
    port = directory.wait_for_event("directory_started", 1.0)["metrics_port"]
    with eviction_process(
        nats_server,
        KVF_EVICTION_POLICY="density",
        KVF_EVICTION_ADMISSION="predicted",
        KVF_EVICTION_ADMISSION_PUBLISH_MS="100",
        KVF_EVICTION_SEGMENTS_REFRESH_MS="200",
    ):
        filt = asyncio.run(next_admission_filter(nats_server.url))
        assert filt.policy == "density"
        time.sleep(0.3)
        text = asyncio.run(scrape_metrics_async(port))
        assert (metric_value(text, "kvfabric_directory_admission_filters_received_total") or 0) >= 1
        age = metric_value(text, "kvfabric_directory_admission_filter_age_seconds")
        assert age is not None and 0 <= age < STALE_MS / 1000
    time.sleep(STALE_MS / 1000 + 0.5)  # the policy is gone: its last filter goes stale
    text = asyncio.run(scrape_metrics_async(port))
    age = metric_value(text, "kvfabric_directory_admission_filter_age_seconds")
    assert age is not None and age > STALE_MS / 1000
    tokens = prompt(3 * TOKENS_PER_CHUNK, seed=4343)
    with client(nats_server) as kv:
        assert kv.save(tokens, objects_for(tokens, 0, 3)).chunks_saved == 3
    assert asyncio.run(core_event(directory, "admission_admitted_stale")) >= 3

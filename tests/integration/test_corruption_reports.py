"""A reader's checksum mismatch reaches the cluster at once (issue 22): the client reports the
replica (`replica_suspect`), the directory relays it to the segment, the segment re-hashes the
slot and, finding it corrupt, frees it and has the directory drop the replica — so the next
lookup no longer hands it out, within 1 s, with the scrubber off. A report about a replica that
is fine drops nothing; a tenant's report about another tenant's object is not even checked, and
leaves it as it is (its owner's own report then drops it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.client import Hit, KvClient
from kvfabric.ctl.auth import plan_auth, write_auth
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer
from kvfabric.testing.tenants import Secure
from tests.integration.clientkit import (
    CHUNK_BYTES,
    TOKENS_PER_CHUNK,
    client,
    corrupt_stored_byte,
    objects_for,
    prompt,
)
from tests.integration.cluster import directory_process, segment_process

pytestmark = pytest.mark.integration

CHUNKS = 4
DROPPED_WITHIN_S = 1.0
NO_SCRUB = {"KVF_SEGMENT_SCRUB_BYTES_PER_S": "0"}  # only a report can find the flipped byte


@pytest.fixture
def plain(nats_server: NatsServer) -> Iterator[NatsServer]:
    with directory_process(nats_server), segment_process(nats_server, "seg-r", 256 << 20, **NO_SCRUB):
        yield nats_server


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[Secure]:
    doc = write_auth(tmp_path / "auth", plan_auth(["alice", "bob"]), tls=True)
    with NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server:
        secure = Secure(server, doc)
        with (
            directory_process(server, **secure.env("svc-directory")),
            segment_process(server, "seg-rt", 256 << 20, **secure.env("svc-segment"), **NO_SCRUB),
        ):
            yield secure


def load_chunks(kv: KvClient, tokens: list[int]) -> tuple[Hit, int]:
    """A lookup and load of `tokens`: (the hit, chunks loaded); the lease is released."""
    hit = kv.lookup(tokens)
    out = [[bytearray(CHUNK_BYTES)] for _ in range(hit.chunks)]
    loaded = kv.load(hit, out).chunks_loaded if hit.chunks else 0
    kv.release(hit)
    return hit, loaded


def hit_chunks_within(kv: KvClient, tokens: list[int], chunks: int, timeout_s: float) -> float:
    """Seconds until a lookup of `tokens` hits exactly `chunks` chunks (fails after `timeout_s`)."""
    started = time.monotonic()
    while True:
        hit = kv.lookup(tokens)
        kv.release(hit)
        if hit.chunks == chunks:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, f"still {hit.chunks} chunks after {timeout_s} s"
        time.sleep(0.02)


def report(kv: KvClient, hit: Hit, chunk: int) -> m.DirectoryReply:
    """What the client sends on a mismatch, sent by hand (as a forger would)."""
    replica = hit.objects[chunk][0].replicas[0]
    message = m.ReplicaSuspect(
        segment_id=replica.segment_id,
        incarnation=replica.incarnation,
        slot=replica.slot,
        slot_generation=replica.slot_generation,
    )
    router = kv.aio.router
    assert router is not None
    future = asyncio.run_coroutine_threadsafe(router.ask_any("replica_suspect", message, 5.0), kv._loop)
    return future.result(10)


def test_a_corrupt_replica_seen_by_a_reader_is_dropped_within_a_second(plain: NatsServer) -> None:
    tokens = prompt(CHUNKS * TOKENS_PER_CHUNK, seed=11)
    with client(plain) as writer:
        assert writer.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
    with client(plain) as reader:
        hit = reader.lookup(tokens)
        assert hit.chunks == CHUNKS
        corrupt_stored_byte(hit, 2)
        reader.release(hit)
        _, loaded = load_chunks(reader, tokens)
        assert loaded == 2  # the verified prefix: the engine recomputes chunks 2..3
        # The next lookup stops at chunk 2 (its only replica is gone), not a failed load again.
        assert hit_chunks_within(reader, tokens, 2, DROPPED_WITHIN_S) < DROPPED_WITHIN_S
        assert reader.aio.metrics.corrupt_reports.labels("relayed")._value.get() == 1


def test_a_report_about_a_good_replica_drops_nothing(plain: NatsServer) -> None:
    tokens = prompt(CHUNKS * TOKENS_PER_CHUNK, seed=12)
    with client(plain) as kv:
        assert kv.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        hit = kv.lookup(tokens)
        reply = report(kv, hit, 1)
        assert isinstance(reply, m.ReplicaSuspectReply) and reply.relayed
        kv.release(hit)
        time.sleep(0.5)  # the segment re-hashed it meanwhile (fine: nothing happens)
        _, loaded = load_chunks(kv, tokens)
        assert loaded == CHUNKS


def test_another_tenants_report_leaves_the_replica_to_its_owner(secure: Secure) -> None:
    tokens = prompt(CHUNKS * TOKENS_PER_CHUNK, seed=13)
    with secure.client("alice") as alice, secure.client("bob") as bob:
        assert alice.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        hit = alice.lookup(tokens)
        assert hit.chunks == CHUNKS
        corrupt_stored_byte(hit, 1, tls=secure.data_tls())
        reply = report(bob, hit, 1)  # bob knows where alice's bytes lie (and that they are bad)
        assert isinstance(reply, m.ReplicaSuspectReply) and reply.relayed  # answered alike
        time.sleep(0.5)
        again = alice.lookup(tokens)
        assert again.chunks == CHUNKS  # not bob's to question: the segment did not even look
        alice.release(again)
        assert isinstance(report(alice, hit, 1), m.ReplicaSuspectReply)
        alice.release(hit)
        assert hit_chunks_within(alice, tokens, 1, DROPPED_WITHIN_S) < DROPPED_WITHIN_S

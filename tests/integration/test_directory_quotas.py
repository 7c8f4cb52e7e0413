"""Quotas and rate limits against a real directory + segment: tenant A's quota holds under
concurrent writers while tenant B saves freely; a tenant over its request rate is answered
`rate_limited` (a miss for the engine, never an exception)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading

import nats
import pytest
from typer.testing import CliRunner

from kvfabric.client import ClientSettings, EngineSpec, KvClient, SaveResult
from kvfabric.ctl.cli import app
from kvfabric.format.errors import RateLimited
from kvfabric.format.key import ShareDomain, chunk_groups_for_prefix
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer
from tests.integration.clientkit import CHUNK_BYTES, SPEC, TOKENS_PER_CHUNK, objects_for, prompt
from tests.integration.cluster import directory_call, directory_process, segment_process

pytestmark = pytest.mark.integration

SPEC_B = dataclasses.replace(SPEC, domain=ShareDomain(tenant_id="tenant-b", salt=b"tenant-b-salt-16"))
SPEC_C = dataclasses.replace(SPEC, domain=ShareDomain(tenant_id="tenant-c", salt=b"tenant-c-salt-16"))
A, B, C = (bytes(s.domain.digest()) for s in (SPEC, SPEC_B, SPEC_C))
A_CHUNKS_MAX = 10
WRITERS = 4
CHUNKS_PER_SAVE = 6


def kv(nats_server: NatsServer, spec: EngineSpec) -> KvClient:
    return KvClient(ClientSettings(nats_url=nats_server.url), spec)


async def ask(url: str, verb: str, message: m.DirectoryRequest) -> object:
    """One directory request (a listing: merged over every shard) on a connection of its own."""
    nc = await nats.connect(url)
    try:
        return await directory_call(nc, verb, message)
    finally:
        await nc.close()


def tenants(url: str) -> dict[bytes, m.TenantInfo]:
    reply = asyncio.run(ask(url, "list_tenants", m.ListTenants()))
    assert isinstance(reply, m.TenantList)
    return {t.domain_digest: t for t in reply.tenants}


def test_quota_holds_under_concurrent_writers_and_spares_other_tenants(nats_server: NatsServer) -> None:
    quotas = {
        A.hex(): {"bytes_max": A_CHUNKS_MAX * CHUNK_BYTES, "objects_max": A_CHUNKS_MAX},
        # 0.1/s: a token every 10 s, so a client started after the first lookup is still refused
        # on a slow host (at 0.5/s a client start of over 2 s would have been answered).
        C.hex(): {"requests_per_s": 0.1, "burst": 1},
    }
    with (
        directory_process(
            nats_server, KVF_DIRECTORY_SHARDS="1", KVF_DIRECTORY_TENANT_QUOTAS=json.dumps(quotas)
        ),
        segment_process(nats_server, "seg-q"),
    ):
        results: list[SaveResult] = []
        lock = threading.Lock()

        def writer(i: int) -> None:
            tokens = prompt(CHUNKS_PER_SAVE * TOKENS_PER_CHUNK, seed=100 + i)
            with kv(nats_server, SPEC) as client:
                result = client.save(tokens, objects_for(tokens, 0, CHUNKS_PER_SAVE))
            with lock:
                results.append(result)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(WRITERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == WRITERS
        saved = sum(r.chunks_saved for r in results)
        refused = sum(r.causes.get("quota_exceeded", 0) for r in results)
        assert saved == A_CHUNKS_MAX  # the quota, exactly: nothing else failed
        assert refused == WRITERS * CHUNKS_PER_SAVE - A_CHUNKS_MAX
        row = tenants(nats_server.url)[A]
        assert (row.used_bytes, row.objects) == (A_CHUNKS_MAX * CHUNK_BYTES, A_CHUNKS_MAX)
        assert row.bytes_max == A_CHUNKS_MAX * CHUNK_BYTES and row.quota_exceeded == refused

        tokens = prompt(3 * CHUNKS_PER_SAVE * TOKENS_PER_CHUNK, seed=7)
        with kv(nats_server, SPEC_B) as client_b:  # tenant B: no quota, unaffected by A's
            result_b = client_b.save(tokens, objects_for(tokens, 0, 3 * CHUNKS_PER_SAVE))
            assert result_b.chunks_saved == 3 * CHUNKS_PER_SAVE and not result_b.causes
            assert client_b.lookup(tokens).tokens == len(tokens)
        assert tenants(nats_server.url)[B].objects == 3 * CHUNKS_PER_SAVE

        # Tenant C: 0.1 requests/s, burst 1: the second lookup at once is refused.
        (group,) = chunk_groups_for_prefix(SPEC_C.domain, SPEC_C.model, SPEC_C.layout, prompt(16))
        lookup = m.Lookup(holder_id="c", groups=[group.group_id()])
        first = asyncio.run(ask(nats_server.url, "lookup", lookup))
        assert isinstance(first, m.LookupReply) and first.hit_chunks == 0
        with pytest.raises(RateLimited) as caught:
            asyncio.run(ask(nats_server.url, "lookup", lookup))
        assert caught.value.code == "rate_limited" and caught.value.retryable
        assert 0 < caught.value.retry_after_ms <= 10_000
        with kv(nats_server, SPEC_C) as client_c:  # the engine sees a miss with a cause
            hit = client_c.lookup(prompt(16))
            assert hit.tokens == 0 and hit.cause == "rate_limited"
        assert tenants(nats_server.url)[C].rate_limited == 2

        # kvctl shows usage against limits (table and JSON)
        table = CliRunner().invoke(app, ["tenants", "ls", "--nats-url", nats_server.url])
        assert table.exit_code == 0, table.output
        assert A.hex() in table.output and "(100%)" in table.output and "(default)" in table.output
        doc = CliRunner().invoke(app, ["tenants", "ls", "--json", "--nats-url", nats_server.url])
        rows = {t["domain_digest"]: t for t in json.loads(doc.output)["tenants"]}
        assert rows[A.hex()]["objects"] == A_CHUNKS_MAX and rows[C.hex()]["requests_per_s"] == 0.1

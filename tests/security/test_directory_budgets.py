"""Hostile tenant vs shared directory resources (issue 21 rows 3, 4, 5, 12), on a real cluster.

Bob attacks with his own credentials (raw NATS on his tenant subjects); alice is the victim
tenant using the engine client. Each test floods one shared resource of the directory and shows
it held: bob is stopped at his own budget (`busy` / `bad_request` / `batch_too_large`, nothing
kept), alice's saves still succeed, the directory's memory stays bounded.

- Row 3: put_begin without ever writing reserves at most bob's share of the capacity
  (`KVF_DIRECTORY_TENANT_PENDING_CAPACITY_PCT`), for at most `KVF_DIRECTORY_WRITE_TTL_MS_MAX`.
- Row 4: bob holds at most his share of the pending-object table.
- Row 5: holder ids longer than `HOLDER_ID_CHARS_MAX` are refused at decode; a tenant's pin
  lasts at most an hour.
- Row 12: a put_begin whose reply would exceed NATS's max payload is refused before any state;
  the client splits a large save so that every reply fits.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import pytest

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.ctl.auth import plan_auth, write_auth
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import BadRequest, BatchTooLarge, KvfError
from kvfabric.format.ids import ObjectKey
from kvfabric.format.key import KVKey, chunk_groups_for_prefix
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer, ServiceProcess
from kvfabric.testing.tenants import Secure
from tests.integration.clientkit import TOKENS_PER_CHUNK, objects_for, prompt
from tests.integration.cluster import ask_directory, directory_process, directory_router, segment_process
from tests.integration.test_tenancy import as_admin

pytestmark = pytest.mark.integration

ARENA_BYTES = 32 << 20
MIB = 1 << 20
SEGMENT_IDS = itertools.count()  # distinct per test and per process (locks are per id and folder)


@contextmanager
def two_tenants(
    tmp_path: Path, *, arena_bytes: int = ARENA_BYTES, env: dict[str, str] | None = None
) -> Iterator[tuple[Secure, ServiceProcess]]:
    """Tenants alice and bob on one authenticated cluster (one directory shard, so every key of
    a test meets in one core), with the directory's defaults unless `env` says otherwise."""
    doc = write_auth(tmp_path / "auth", plan_auth(["alice", "bob"]), tls=True)
    with NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server:
        secure = Secure(server, doc)
        with (
            directory_process(
                server, **secure.env("svc-directory"), KVF_DIRECTORY_SHARDS="1", **(env or {})
            ) as directory,
            segment_process(
                server, f"bud-{os.getpid()}-{next(SEGMENT_IDS)}", arena_bytes, **secure.env("svc-segment")
            ),
        ):
            yield secure, directory


@asynccontextmanager
async def as_bob(secure: Secure) -> AsyncIterator[DirectoryRouter]:
    """Bob's connection (his credentials, his tenant subjects) and a router over it."""
    nc = await secure.connect(secure.tenant_auth("bob"))
    try:
        yield await directory_router(nc, "bob")
    finally:
        await nc.close()


def bob_keys(secure: Secure, n: int, seed: int) -> list[ObjectKey]:
    spec = secure.spec("bob")
    tokens = prompt(n * spec.layout.tokens_per_chunk, seed=seed)
    groups = chunk_groups_for_prefix(spec.domain, spec.model, spec.layout, tokens)
    return [KVKey(chunk_group=g, tp_rank=0, pp_stage=0, layer_group=0).object_key() for g in groups]


async def bob_begins(
    bob: DirectoryRouter, keys: list[ObjectKey], size: int, batch: int, writer: str = "bob-w"
) -> tuple[list[m.BeginResult], str]:
    """Bob begins `keys` (asking the longest write deadline) and never writes; stops at his
    first refusal. Returns the results he got and the refusal's code ("" if none)."""
    got: list[m.BeginResult] = []
    for start in range(0, len(keys), batch):
        objects = [
            m.ObjectSpec(key=k, size_bytes=size, checksum=checksum(k)) for k in keys[start : start + batch]
        ]
        request = m.PutBegin(
            writer_id=writer, request_id=f"flood-{start}", objects=objects, write_ttl_ms=m.WRITE_TTL_MS_MAX
        )
        try:
            reply = await ask_directory(bob, "put_begin", request)
        except KvfError as err:
            return got, err.code
        assert isinstance(reply, m.PutBeginReply)
        got += reply.results
    return got, ""


def alice_saves(secure: Secure, chunks: int, seed: int) -> int:
    tokens = prompt(chunks * TOKENS_PER_CHUNK, seed=seed)
    with secure.client("alice") as alice:
        result = alice.save(tokens, objects_for(tokens, 0, chunks))
        assert not result.causes, result
        return result.chunks_saved


async def reserved_bytes(secure: Secure) -> int:
    listed = await as_admin(secure, "list_segments", m.ListSegments())
    assert isinstance(listed, m.SegmentList)
    return sum(s.reserved_bytes for s in listed.segments)


def rss_bytes(proc: ServiceProcess) -> int:
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_put_begin_without_writes_reserves_only_bobs_share_for_a_write_deadline(tmp_path: Path) -> None:
    """Row 3: bob put_begins 1 MiB objects (600 s asked) and never writes. He is `busy` once he
    holds a quarter of the 32 MiB segment; his deadlines are 30 s; alice saves meanwhile."""
    with two_tenants(tmp_path) as (secure, _):

        async def attack() -> tuple[list[m.BeginResult], str, float]:
            async with as_bob(secure) as bob:
                asked_ms = time.time() * 1000
                results, refused = await bob_begins(bob, bob_keys(secure, 40, seed=1), MIB, batch=2)
                return results, refused, asked_ms

        results, refused, asked_ms = asyncio.run(attack())
        placed = [r for r in results if r.status == "placed"]
        assert refused == "busy" and {r.status for r in results} == {"placed"}
        assert len(placed) * MIB <= ARENA_BYTES // 4  # his share of the capacity, no more
        assert all(r.deadline_ms <= asked_ms + 30_000 + 5_000 for r in placed)  # not 600 s
        assert alice_saves(secure, 8, seed=2) == 8  # 512 KiB of hers fit beside his reservations


def test_bob_fills_only_his_share_of_the_pending_table(tmp_path: Path) -> None:
    """Row 4: a table of 400 pending objects, 100 per tenant: bob's flood stops at 100; alice's
    saves still find room."""
    env = {"KVF_DIRECTORY_PENDING_OBJECTS_MAX": "400", "KVF_DIRECTORY_TENANT_PENDING_OBJECTS_MAX": "100"}
    with two_tenants(tmp_path, env=env) as (secure, _):

        async def attack() -> tuple[list[m.BeginResult], str]:
            async with as_bob(secure) as bob:  # several writers of his, as several engines would
                first, _ = await bob_begins(bob, bob_keys(secure, 60, seed=3), 1, batch=20, writer="e1")
                more, refused = await bob_begins(bob, bob_keys(secure, 500, seed=4), 1, batch=20, writer="e2")
                return first + more, refused

        results, refused = asyncio.run(attack())
        assert refused == "busy" and len(results) == 100
        assert alice_saves(secure, 16, seed=5) == 16


def test_huge_holder_ids_are_refused_and_a_tenants_pin_lasts_an_hour(tmp_path: Path) -> None:
    """Row 5: 100 pins with 900 KiB holder ids are refused at decode (the directory's RSS does
    not grow by their 90 MiB); a 24 h pin of bob's lasts an hour; alice still saves."""
    with two_tenants(tmp_path) as (secure, directory):
        tokens = prompt(TOKENS_PER_CHUNK, seed=6)
        with secure.client("bob") as bob:
            assert bob.save(tokens, objects_for(tokens, 0, 1)).chunks_saved == 1
        group = chunk_groups_for_prefix(
            secure.spec("bob").domain, secure.spec("bob").model, secure.spec("bob").layout, tokens
        )[0].group_id()

        async def attack() -> tuple[int, m.PinReply, float]:
            async with as_bob(secure) as bob:
                refused = 0
                for i in range(100):
                    pin = m.Pin(
                        holder_id=f"{i:06d}" + "h" * (900 << 10), groups=[group], ttl_ms=m.PIN_TTL_MS_MAX
                    )
                    try:
                        await ask_directory(bob, "pin", pin)
                    except BadRequest:
                        refused += 1
                asked_ms = time.time() * 1000
                day = m.Pin(holder_id="h" * m.HOLDER_ID_CHARS_MAX, groups=[group], ttl_ms=m.PIN_TTL_MS_MAX)
                reply = await ask_directory(bob, "pin", day)
                assert isinstance(reply, m.PinReply)
                return refused, reply, asked_ms

        before = rss_bytes(directory)
        refused, pinned, asked_ms = asyncio.run(attack())
        grown = rss_bytes(directory) - before
        assert grown < 30 * MIB, f"the directory grew {grown / MIB:.0f} MiB ({refused} of 100 refused)"
        assert refused == 100
        assert pinned.pinned_groups == 1
        assert pinned.expires_ms <= asked_ms + 3_600_000 + 5_000  # an hour, not the 24 h asked
        assert alice_saves(secure, 4, seed=7) == 4


def test_a_put_begin_whose_reply_would_not_fit_is_refused_before_any_state(tmp_path: Path) -> None:
    """Row 12: bob's put_begin of 4,096 objects (a reply of ~2 MiB, over NATS's 1 MiB) is refused
    with `batch_too_large` naming how many fit, and reserves nothing; alice's save of 3,000
    objects in one shard goes in put_begins whose replies fit, and succeeds."""
    with two_tenants(tmp_path, arena_bytes=64 << 20) as (secure, _):

        async def attack() -> tuple[BatchTooLarge, int, int]:
            async with as_bob(secure) as bob:
                before = await reserved_bytes(secure)
                keys = bob_keys(secure, m.PUT_BATCH_OBJECTS_MAX, seed=8)
                objects = [m.ObjectSpec(key=k, size_bytes=1, checksum=checksum(k)) for k in keys]
                request = m.PutBegin(writer_id="w" * m.HOLDER_ID_CHARS_MAX, request_id="big", objects=objects)
                with pytest.raises(BatchTooLarge) as caught:
                    await ask_directory(bob, "put_begin", request)
                return caught.value, before, await reserved_bytes(secure)

        refused, before, after = asyncio.run(attack())
        assert refused.code == "batch_too_large"
        assert 0 < refused.details["limit"] < m.PUT_BATCH_OBJECTS_MAX
        assert after == before  # nothing reserved
        chunks = 3_000
        tokens = prompt(chunks * TOKENS_PER_CHUNK, seed=9)
        small = [[bytes([i % 251]) * 1024] for i in range(chunks)]
        with secure.client("alice") as alice:
            result = alice.save(tokens, small)
            assert result.chunks_saved == chunks and not result.causes, result
            assert alice.lookup(tokens[: 64 * TOKENS_PER_CHUNK]).chunks == 64
        assert asyncio.run(reserved_bytes(secure)) == chunks * 1024  # exactly what was published

"""Requests that only give resources back are never refused for load (issue 20).

A lease release, an unpin and a put abort free what new work is waiting for. The directory serves
them from in-flight slots of their own (`ServiceRuntime`'s give-back lane, a quarter per tenant,
separate from the slots new work takes), and no rate token is charged for them. So: a tenant
whose share of the slots is full of slow lookups still releases, unpins and aborts; a client
closing with 1,000 leases leaves none held, even then; a release flood (an unbounded close, or a
hostile tenant releasing leases that do not exist) makes no one's `put_begin` busy.

The slots are filled with lookups held by the reply pad (`KVF_DIRECTORY_LOOKUP_REPLY_MIN_MS`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NatsClient

from kvfabric.client import AsyncKvClient
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.core.authz import SCOPE_SEPARATOR
from kvfabric.ctl.auth import plan_auth, write_auth
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Busy, KvfError
from kvfabric.format.ids import GroupId, ObjectKey
from kvfabric.format.key import KVKey, chunk_groups_for_prefix
from kvfabric.proto import directory as m
from kvfabric.testing import NatsServer
from kvfabric.testing.tenants import Secure
from tests.integration.clientkit import TOKENS_PER_CHUNK, objects_for, prompt
from tests.integration.cluster import ask_directory, directory_process, directory_router, segment_process
from tests.integration.test_tenancy import admin_leases

pytestmark = pytest.mark.integration

PAD_MS = 3_000  # how long a lookup holds its in-flight slot in the saturated tests
LEASES = 1_000


def keys_of(secure: Secure, tenant: str, tokens: list[int]) -> list[ObjectKey]:
    spec = secure.spec(tenant)
    groups = chunk_groups_for_prefix(spec.domain, spec.model, spec.layout, tokens)
    return [KVKey(chunk_group=g, tp_rank=0, pp_stage=0, layer_group=0).object_key() for g in groups]


def groups_of(secure: Secure, tenant: str, tokens: list[int]) -> list[GroupId]:
    spec = secure.spec(tenant)
    return [g.group_id() for g in chunk_groups_for_prefix(spec.domain, spec.model, spec.layout, tokens)]


def put_begin(secure: Secure, tenant: str, seed: int, writer: str = "w") -> m.PutBegin:
    """A put of one fresh chunk (not written: it stays pending until aborted or expired)."""
    data = objects_for(prompt(TOKENS_PER_CHUNK, seed=seed), 0, 1)[0][0]
    (key,) = keys_of(secure, tenant, prompt(TOKENS_PER_CHUNK, seed=seed))
    spec = m.ObjectSpec(key=key, size_bytes=len(data), checksum=checksum(data))
    return m.PutBegin(writer_id=writer, request_id=f"r{seed}", objects=[spec])


async def outcome(call: Awaitable[msgspec.Struct]) -> str:
    try:
        await call
        return "ok"
    except Busy:
        return "busy"


async def started_client(secure: Secure, tenant: str, **overrides: Any) -> AsyncKvClient:
    settings = secure.client_settings(tenant, lookup_timeout_ms=4 * PAD_MS, **overrides)
    kv = AsyncKvClient(settings, secure.spec(tenant))
    await kv.start()
    return kv


async def saved_prompt(kv: AsyncKvClient, seed: int) -> list[int]:
    tokens = prompt(TOKENS_PER_CHUNK, seed=seed)  # one chunk: one shard, one lease per lookup
    assert (await kv.save(tokens, objects_for(tokens, 0, 1))).chunks_saved == 1
    return tokens


async def saturate(router: DirectoryRouter, share: int) -> list[asyncio.Task[str]]:
    """`share` padded lookups holding every slot of the tenant's share for PAD_MS; proven full
    by one more being refused `busy` at once."""
    lookup = m.Lookup(holder_id="flood", groups=[])
    flood = [asyncio.create_task(outcome(ask_directory(router, "lookup", lookup))) for _ in range(share)]
    await asyncio.sleep(0.3 + share / 1000)  # every one admitted
    assert await outcome(ask_directory(router, "lookup", lookup)) == "busy"
    return flood


def held_by(held: dict[tuple[int, int], str], tenant: str, holder: str) -> int:
    return sum(1 for h in held.values() if h == f"{tenant}{SCOPE_SEPARATOR}{holder}")


async def connect(secure: Secure, tenant: str) -> NatsClient:
    return await nats.connect(secure.nats.url, **secure.tenant_auth(tenant).connect_options())


def test_release_unpin_and_abort_pass_a_share_full_of_new_work(tmp_path: Path) -> None:
    """Bob's share of the directory's slots (16 of 64) is held by padded lookups: a 17th lookup
    is `busy`, but his lease release, unpin and put abort are served at once."""
    doc = write_auth(tmp_path / "auth", plan_auth(["alice", "bob"]), tls=True)
    with NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server:
        secure = Secure(server, doc)
        with (
            directory_process(
                server, **secure.env("svc-directory"), KVF_DIRECTORY_LOOKUP_REPLY_MIN_MS=str(PAD_MS)
            ),
            segment_process(server, "seg-g", 64 << 20, **secure.env("svc-segment")),
        ):

            async def run() -> None:
                kv = await started_client(secure, "bob")
                nc = await connect(secure, "bob")
                try:
                    tokens = await saved_prompt(kv, seed=1)
                    router = await directory_router(nc, "bob")
                    (group,) = groups_of(secure, "bob", tokens)
                    shard = router.shard_of(group)
                    hit = await ask_directory(router, "lookup", m.Lookup(holder_id="h", groups=[group]))
                    assert isinstance(hit, m.LookupReply) and hit.lease_id
                    pin = await ask_directory(
                        router, "pin", m.Pin(holder_id="h", groups=[group], ttl_ms=60_000)
                    )
                    assert isinstance(pin, m.PinReply) and pin.pin_id
                    begin = put_begin(secure, "bob", seed=2)
                    begun = await ask_directory(router, "put_begin", begin)
                    assert isinstance(begun, m.PutBeginReply) and begun.results[0].status == "placed"

                    flood = await saturate(router, share=16)
                    began = time.monotonic()
                    release = m.LeaseRelease(holder_id="h", lease_id=hit.lease_id, shard=shard)
                    released = await ask_directory(router, "lease_release", release)
                    assert isinstance(released, m.LeaseReply) and released.lease_id == hit.lease_id
                    unpin = m.Unpin(holder_id="h", pin_id=pin.pin_id, shard=shard)
                    unpinned = await ask_directory(router, "unpin", unpin)
                    assert isinstance(unpinned, m.PinReply) and unpinned.pin_id == pin.pin_id
                    abort = m.PutAbort(writer_id="w", request_id="a2", keys=[o.key for o in begin.objects])
                    aborted = await ask_directory(router, "put_abort", abort)
                    assert isinstance(aborted, m.PutAbortReply) and aborted.aborted == 1
                    assert time.monotonic() - began < PAD_MS / 1000 / 2  # at once, not after the pad
                    assert not any(task.done() for task in flood)  # the share stayed full meanwhile
                    assert await asyncio.gather(*flood) == ["ok"] * 16
                finally:
                    await nc.close()
                    await kv.close()

            asyncio.run(run())
            held = asyncio.run(admin_leases(secure))
            assert held_by(held, "bob", "h") == 0  # lease and pin gone


def test_a_client_closing_with_1000_leases_under_a_full_share_leaves_none_held(tmp_path: Path) -> None:
    """Bob's client holds 1,000 leases; his share of the slots (1,024 of 4,096) is full of padded
    lookups when it closes. Every lease is released anyway (before: all `busy`, swallowed, held
    until their TTL)."""
    doc = write_auth(tmp_path / "auth", plan_auth(["alice", "bob"]), tls=True)
    with NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server:
        secure = Secure(server, doc)
        with (
            directory_process(
                server,
                **secure.env("svc-directory"),
                KVF_DIRECTORY_LOOKUP_REPLY_MIN_MS=str(PAD_MS),
                KVF_INFLIGHT_MAX="4096",
            ),
            segment_process(server, "seg-g", 64 << 20, **secure.env("svc-segment")),
        ):

            async def run() -> tuple[str, bool]:
                kv = await started_client(secure, "bob")
                nc = await connect(secure, "bob")
                try:
                    tokens = await saved_prompt(kv, seed=3)
                    hits = await asyncio.gather(*(kv.lookup(tokens) for _ in range(LEASES)))
                    assert sum(len(h.shard_leases) for h in hits) == LEASES
                    holder = kv.settings.holder_id
                    assert held_by(await admin_leases(secure), "bob", holder) == LEASES

                    flood = await saturate(await directory_router(nc, "bob"), share=1024)
                    await asyncio.wait_for(kv.close(), PAD_MS / 1000)
                    still_full = not any(task.done() for task in flood)
                    await asyncio.gather(*flood)
                    return holder, still_full
                finally:
                    await nc.close()
                    await kv.close()

            holder, still_full = asyncio.run(run())
            assert held_by(asyncio.run(admin_leases(secure)), "bob", holder) == 0
            assert still_full  # the close ran while the share was full


def test_a_release_flood_makes_no_ones_put_begin_busy(tmp_path: Path) -> None:
    """Bob's old client sends its 1,000 leases back all at once and a hostile connection of his
    releases 1,000 leases that do not exist: meanwhile bob's next client and alice put, and
    neither is ever `busy`; then the old client's close gives back whatever is left."""
    doc = write_auth(tmp_path / "auth", plan_auth(["alice", "bob"]), tls=True)
    with NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server:
        secure = Secure(server, doc)
        with (
            directory_process(server, **secure.env("svc-directory")),
            segment_process(server, "seg-g", 64 << 20, **secure.env("svc-segment")),
        ):

            async def run() -> tuple[str, list[str], list[str]]:
                old = await started_client(secure, "bob")
                flooder, nxt, alice = [await connect(secure, t) for t in ("bob", "bob", "alice")]
                try:
                    tokens = await saved_prompt(old, seed=4)
                    gate = asyncio.Semaphore(8)

                    async def lookup() -> list[tuple[int, int]]:
                        async with gate:
                            return list((await old.lookup(tokens)).shard_leases)

                    leases = [x for h in await asyncio.gather(*(lookup() for _ in range(LEASES))) for x in h]
                    assert len(leases) == LEASES
                    holder = old.settings.holder_id
                    flood_router = await directory_router(flooder, "bob")
                    floods = [
                        m.LeaseRelease(holder_id=holder, lease_id=lease_id, shard=shard)
                        for shard, lease_id in leases
                    ] + [  # leases that do not exist (a hostile tenant's)
                        m.LeaseRelease(holder_id="nobody", lease_id=10**9 + i, shard=i % flood_router.shards)
                        for i in range(LEASES)
                    ]
                    next_router = await directory_router(nxt, "bob")
                    alice_router = await directory_router(alice, "alice")
                    for router, tenant in ((next_router, "bob"), (alice_router, "alice")):
                        for seed in (10, 11):  # connections warm, maps known
                            await ask_directory(router, "put_begin", put_begin(secure, tenant, seed))

                    async def release(message: m.LeaseRelease) -> str:
                        try:
                            await ask_directory(flood_router, "lease_release", message)
                        except Busy:
                            return "busy"
                        except KvfError:  # the flood's own answers: not_found mostly
                            return "error"
                        return "ok"

                    flood = [asyncio.create_task(release(x)) for x in floods]
                    bob_puts: list[str] = []
                    alice_puts: list[str] = []
                    seed = 100
                    while not all(task.done() for task in flood):
                        seed += 1
                        bob_puts.append(
                            await outcome(
                                ask_directory(next_router, "put_begin", put_begin(secure, "bob", seed))
                            )
                        )
                        alice_puts.append(
                            await outcome(
                                ask_directory(alice_router, "put_begin", put_begin(secure, "alice", seed))
                            )
                        )
                    await asyncio.gather(*flood)
                    await old.close()  # what the flood left (refused busy) goes back now
                    return holder, bob_puts, alice_puts
                finally:
                    for nc in (flooder, nxt, alice):
                        await nc.close()
                    await old.close()

            holder, bob_puts, alice_puts = asyncio.run(run())
            assert bob_puts and alice_puts
            assert bob_puts.count("busy") == 0, bob_puts
            assert alice_puts.count("busy") == 0, alice_puts
            assert held_by(asyncio.run(admin_leases(secure)), "bob", holder) == 0

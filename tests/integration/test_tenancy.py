"""Two tenants on one authenticated cluster (NATS users + permissions + TLS from `kvctl auth init`).

Tenant bob holds alice's raw chunk group ids and keys, and still cannot read, probe (every answer
is byte-identical to a miss), pin, evict, list, show or lease alice's objects, nor write under her
keys; forging his own domain digest into her ids changes nothing. NATS itself refuses a client
without credentials, a tenant on service subjects and a tenant on another tenant's subjects. A
shared domain granted to both is the one way to share. A forged or expired ticket stores nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import msgspec
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from typer.testing import CliRunner

from kvfabric.client import KvClient
from kvfabric.client.transfers import read_ref
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.cluster.natsauth import NatsAuth, nats_auth_from_env
from kvfabric.cluster.requests import request
from kvfabric.core.authz import SCOPE_SEPARATOR
from kvfabric.ctl import queries
from kvfabric.ctl.auth import plan_auth, write_auth
from kvfabric.ctl.cli import app as kvctl_app
from kvfabric.dataplane.addresses import split_host_port
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.directory.shard_map import SHARD_MAP_TENANT_PER_S
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import (
    BadRequest,
    Busy,
    Indeterminate,
    KvfError,
    NotFound,
    RateLimited,
    Unauthorized,
)
from kvfabric.format.ids import DomainDigest, GroupId, ObjectKey, domain_in_id
from kvfabric.format.key import ChunkGroupId, KVKey, chunk_groups_for_prefix
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.dataplane import ReadRef
from kvfabric.proto.segment import DrainRequest, SegmentState, segment_decoder
from kvfabric.proto.subjects import (
    Service,
    instance_subject,
    segment_subject,
    tenant_instance_subject,
    tenant_subject,
)
from kvfabric.segment_storage.backend import CLOCK_SKEW_TOLERANCE_MS_DEFAULT
from kvfabric.testing import NatsServer
from kvfabric.testing.tenants import Secure, groups_of
from tests.integration.clientkit import TOKENS_PER_CHUNK, objects_for, prompt
from tests.integration.cluster import (
    TIMEOUT_S,
    ask_directory,
    directory_call,
    directory_process,
    directory_router,
    segment_process,
)

pytestmark = pytest.mark.integration

CHUNKS = 3


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[Secure]:
    doc = write_auth(tmp_path / "auth", plan_auth(["alice", "bob"], {"pub": ["alice", "bob"]}), tls=True)
    with NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server:
        secure = Secure(server, doc)
        with (
            directory_process(server, **secure.env("svc-directory")),
            segment_process(server, "seg-t", 256 << 20, **secure.env("svc-segment")),
        ):
            yield secure


async def as_tenant(nc: NatsClient, tenant: str, verb: str, message: msgspec.Struct) -> msgspec.Struct:
    """A tenant's request, on its tenant subjects (`kvf.v1.directory.t.<tenant>.<verb>.<instance>`)."""
    return await ask_directory(await directory_router(nc, tenant), verb, message)


async def as_admin(secure: Secure, verb: str, message: msgspec.Struct) -> msgspec.Struct:
    nc = await secure.connect(nats_auth_from_env(secure.env("admin")))
    try:
        return await directory_call(nc, verb, message)
    finally:
        await nc.close()


async def admin_leases(secure: Secure) -> dict[tuple[int, int], str]:
    """(shard, lease id) -> holder of every lease and pin (ids are per shard)."""
    nc = await secure.connect(nats_auth_from_env(secure.env("admin")))
    try:
        listed = await queries.list_leases(await directory_router(nc), m.LIST_LIMIT_MAX, TIMEOUT_S)
        return {(x.shard, x.lease.lease_id): x.lease.holder_id for x in listed}
    finally:
        await nc.close()


async def directory_instance(secure: Secure) -> str:
    """The directory instance leading shard 0 (its subjects end in its id)."""
    nc = await secure.connect(nats_auth_from_env(secure.env("admin")))
    try:
        return (await directory_router(nc)).routes[0].instance
    finally:
        await nc.close()


G = TypeVar("G", GroupId, ObjectKey)


def group_key(group: ChunkGroupId) -> ObjectKey:
    return KVKey(chunk_group=group, tp_rank=0, pp_stage=0, layer_group=0).object_key()


def forge(group_or_key: G, digest: bytes) -> G:
    """Alice's id with bob's domain digest written over hers (bytes [4:20])."""
    return type(group_or_key)(group_or_key[:4] + digest + group_or_key[20:])


def without_epoch(reply: msgspec.Struct) -> bytes:
    return encode(msgspec.structs.replace(reply, epoch=0))


async def _bob_probes(secure: Secure, alice_groups: list[GroupId], alice_keys: list[ObjectKey]) -> None:
    bob_digest = secure.spec("bob").domain.digest()
    never = groups_of(secure.spec("bob"), prompt(CHUNKS * TOKENS_PER_CHUNK, seed=99))
    forged = [forge(g, bob_digest) for g in alice_groups]
    nc = await secure.connect(secure.tenant_auth("bob"))
    try:
        miss = await as_tenant(nc, "bob", "lookup", m.Lookup(holder_id="bob", groups=never))
        assert isinstance(miss, m.LookupReply) and miss.hit_chunks == 0
        for probe in (alice_groups, forged, [never[0], *alice_groups]):
            reply = await as_tenant(nc, "bob", "lookup", m.Lookup(holder_id="bob", groups=probe))
            assert without_epoch(reply) == without_epoch(miss)  # byte-identical to a miss

        pin_miss = await as_tenant(nc, "bob", "pin", m.Pin(holder_id="bob", groups=never, ttl_ms=60_000))
        for probe in (alice_groups, forged):
            pin = await as_tenant(nc, "bob", "pin", m.Pin(holder_id="bob", groups=probe, ttl_ms=60_000))
            assert isinstance(pin, m.PinReply) and isinstance(pin_miss, m.PinReply)
            assert pin.pinned_groups == pin_miss.pinned_groups == 0

        for probe in (alice_groups, forged):
            evicted = await as_tenant(nc, "bob", "evict", m.Evict(groups=probe))
            assert isinstance(evicted, m.EvictReply)
            assert [r.status for r in evicted.results] == ["not_found"] * CHUNKS
        missing = await as_tenant(nc, "bob", "evict", m.Evict(groups=never))
        assert isinstance(missing, m.EvictReply) and {r.status for r in missing.results} == {"not_found"}

        alice_digest = domain_in_id(alice_groups[0])
        listed = await as_tenant(nc, "bob", "list_groups", m.ListGroups(domain_digest=alice_digest))
        assert isinstance(listed, m.GroupList) and listed.groups == []
        own = await as_tenant(nc, "bob", "list_groups", m.ListGroups(domain_digest=bob_digest))
        assert isinstance(own, m.GroupList) and own.groups == []
        for group in (alice_groups[0], forged[0], alice_groups[0][58:90], never[0]):
            with pytest.raises(NotFound, match="no such chunk group"):
                await as_tenant(nc, "bob", "show_group", m.ShowGroup(group=group))

        spec = m.ObjectSpec(key=alice_keys[0], size_bytes=4, checksum=checksum(b"evil"))
        with pytest.raises(Unauthorized):
            await as_tenant(nc, "bob", "put_begin", m.PutBegin(writer_id="w", request_id="r", objects=[spec]))
        for verb, kind in (("put_commit", m.PutCommit), ("put_abort", m.PutAbort)):
            with pytest.raises(Unauthorized):
                await as_tenant(nc, "bob", verb, kind(writer_id="w", request_id="r", keys=[alice_keys[0]]))
    finally:
        await nc.close()


def test_another_tenant_cannot_read_probe_pin_evict_list_or_lease(secure: Secure) -> None:
    tokens = prompt(CHUNKS * TOKENS_PER_CHUNK, seed=1)
    with secure.client("alice") as alice:
        assert alice.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        alice_spec = secure.spec("alice")
        alice_groups = groups_of(alice_spec, tokens)
        alice_keys = [
            group_key(g)
            for g in chunk_groups_for_prefix(alice_spec.domain, alice_spec.model, alice_spec.layout, tokens)
        ]
        hit = alice.lookup(tokens)
        assert hit.chunks == CHUNKS
        alice_shard, alice_lease = hit.shard_leases[0]
        asyncio.run(_bob_probes(secure, alice_groups, alice_keys))

        async def steal_lease() -> None:
            nc = await secure.connect(secure.tenant_auth("bob"))
            try:
                holder = alice.settings.holder_id  # even with her holder id and lease id
                for verb, kind in (("lease_release", m.LeaseRelease), ("lease_renew", m.LeaseRenew)):
                    steal = kind(holder_id=holder, lease_id=alice_lease, shard=alice_shard)
                    with pytest.raises(NotFound):
                        await as_tenant(nc, "bob", verb, steal)
            finally:
                await nc.close()

        asyncio.run(steal_lease())
        held = asyncio.run(admin_leases(secure))
        hers = f"alice{SCOPE_SEPARATOR}{alice.settings.holder_id}"
        assert all(held[lease] == hers for lease in hit.shard_leases)  # still hers
        dests = [[bytearray(len(o[0]))] for o in objects_for(tokens, 0, CHUNKS)]
        assert alice.load(hit, dests).tokens == CHUNKS * TOKENS_PER_CHUNK  # nothing of hers was touched
        assert [bytes(d[0]) for d in dests] == [o[0] for o in objects_for(tokens, 0, CHUNKS)]
        alice.release(hit)
        listed = asyncio.run(as_admin(secure, "list_groups", m.ListGroups()))
        assert isinstance(listed, m.GroupList) and len(listed.groups) == CHUNKS


def test_shared_domain_is_the_one_way_to_share(secure: Secure) -> None:
    tokens = prompt(CHUNKS * TOKENS_PER_CHUNK, seed=2)
    with secure.client("alice", "pub") as alice_pub, secure.client("alice") as alice_own:
        assert alice_pub.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        assert alice_own.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
    with secure.client("bob", "pub") as bob_pub, secure.client("bob") as bob_own:
        hit = bob_pub.lookup(tokens)
        assert hit.chunks == CHUNKS
        dests = [[bytearray(len(o[0]))] for o in objects_for(tokens, 0, CHUNKS)]
        assert bob_pub.load(hit, dests).tokens == CHUNKS * TOKENS_PER_CHUNK
        bob_pub.release(hit)
        assert bob_own.lookup(tokens).chunks == 0  # his own domain: alice's private copy is not his


async def _refused(secure: Secure, auth: NatsAuth, subject: str) -> list[str]:
    errors: list[str] = []
    nc = await secure.connect(auth, errors)
    try:
        with pytest.raises(KvfError):
            await request(nc, subject, m.ListSegments(), m.reply_decoder, 1.0)
        await asyncio.sleep(0.1)
        return errors
    finally:
        await nc.close()


def test_nats_refuses_missing_credentials_and_foreign_subjects(secure: Secure) -> None:
    tls_only = NatsAuth(tls_ca=secure.doc["tls_ca"])

    async def no_credentials() -> None:
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await secure.connect(tls_only)
        wrong = NatsAuth(user="tenant-bob", password="not-his-password", tls_ca=secure.doc["tls_ca"])
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await secure.connect(wrong)

    asyncio.run(no_credentials())
    # kvctl without credentials says so, and where a local cluster's operator ones are
    unset = {"KVF_NATS_TLS_CA": secure.doc["tls_ca"], "KVF_NATS_USER": "", "KVF_NATS_PASSWORD_FILE": ""}
    result = CliRunner().invoke(kvctl_app, ["status", "--nats-url", secure.nats.url], env=unset)
    assert result.exit_code == 1 and result.stderr.startswith("unauthorized: "), result.output
    assert "none are set (KVF_NATS_USER" in result.stderr
    bob = secure.tenant_auth("bob")
    instance = asyncio.run(directory_instance(secure))
    for subject in (
        instance_subject(Service.DIRECTORY, "list_segments", instance),  # a service subject
        instance_subject(Service.DIRECTORY, "lookup", instance),
        segment_subject("seg-t", "free"),
        tenant_instance_subject(Service.DIRECTORY, "alice", "lookup", instance),  # another tenant's
        "$JS.API.STREAM.LIST",
    ):
        errors = asyncio.run(_refused(secure, bob, subject))
        assert any("permissions violation for publish" in e.lower() for e in errors), (subject, errors)
    # A tenant cannot listen to another tenant's replies either.
    sub_errors: list[str] = []

    async def eavesdrop() -> None:
        nc = await secure.connect(bob, sub_errors)
        try:
            await nc.subscribe("_INBOX.t.alice.>")
            await nc.flush()
            await asyncio.sleep(0.2)
        finally:
            await nc.close()

    asyncio.run(eavesdrop())
    assert any("permissions violation for subscription" in e.lower() for e in sub_errors)


def test_forged_or_expired_ticket_stores_nothing(secure: Secure) -> None:
    async def run() -> None:
        nc = await secure.connect(secure.tenant_auth("bob"))
        try:
            bob_spec = secure.spec("bob")
            keys = chunk_groups_for_prefix(
                bob_spec.domain, bob_spec.model, bob_spec.layout, prompt(32, seed=5)
            )
            data = os.urandom(4096)
            specs = [
                m.ObjectSpec(key=group_key(g), size_bytes=len(data), checksum=checksum(data))
                for g in keys[:2]
            ]
            begun = await as_tenant(
                nc,
                "bob",
                "put_begin",
                m.PutBegin(writer_id="w", request_id="r", objects=specs, write_ttl_ms=300),
            )
            assert isinstance(begun, m.PutBeginReply)
            forged_ticket = msgspec.structs.replace(
                begun.results[0].tickets[0], deadline_ms=int(time.time() * 1000) + 60_000
            )
            expired = begun.results[1].tickets[0]
            # past its deadline, and past the segments' clock skew tolerance
            await asyncio.sleep(0.5 + CLOCK_SKEW_TOLERANCE_MS_DEFAULT / 1000)
            # A connection's first request must carry a valid credential (docs/security.md, "Data
            # plane before authentication"): each one is refused, and its connection closed.
            tls = secure.data_tls()
            with TcpDataClient.connect(expired.data_addr, tls=tls) as plane, pytest.raises(Unauthorized):
                plane.put(forged_ticket, data)  # a longer deadline breaks the signature
            with TcpDataClient.connect(expired.data_addr, tls=tls) as plane, pytest.raises(Unauthorized):
                plane.put(expired, data)  # past its deadline: no credential any more
        finally:
            await nc.close()
        state = await as_admin(secure, "list_segments", m.ListSegments())
        assert isinstance(state, m.SegmentList)

    asyncio.run(run())

    async def used() -> int:
        nc = await secure.connect(nats_auth_from_env(secure.env("admin")))
        try:
            reply = await request(
                nc,
                segment_subject("seg-t", "drain"),
                DrainRequest(draining=False),
                segment_decoder,
                TIMEOUT_S,
            )
            assert isinstance(reply, SegmentState)
            return reply.used_bytes
        finally:
            await nc.close()

    assert asyncio.run(used()) == 0


def test_no_lease_no_bytes_on_the_data_plane(secure: Secure) -> None:
    """Knowing where alice's bytes lie is not enough: the segment serves a read only with the
    directory's unexpired read token for exactly that replica, on TCP and the local (shm) path."""
    tokens = prompt(CHUNKS * TOKENS_PER_CHUNK, seed=3)
    with secure.client("alice") as alice:
        assert alice.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        short = msgspec.structs.replace(alice.aio.settings, lease_ttl_ms=300)
        with KvClient(short, secure.spec("alice")) as brief:
            hit = brief.lookup(tokens)
            assert hit.chunks == CHUNKS
            location = hit.objects[0][0]
            r = location.replicas[0]
            good = read_ref(r, location.size_bytes)
            bare = ReadRef(r.incarnation, r.slot, r.slot_generation, location.size_bytes)
            forged = msgspec.structs.replace(good, token=bytes(16))
            other_slot = msgspec.structs.replace(good, slot=r.slot + 1)  # a token names one replica
            assert r.data_addr.startswith("tls://")  # the data plane runs over TLS here
            with pytest.raises(BadRequest, match="TLS"):
                TcpDataClient.connect(r.data_addr)  # a reader without the CA is refused
            host, port = split_host_port(r.data_addr)
            with pytest.raises(Indeterminate), TcpDataClient(host, port, timeout_s=2) as plain:
                plain.get([good], [bytearray(location.size_bytes)])  # plain TCP: no answer
            with TcpDataClient.connect(r.data_addr, tls=secure.data_tls()) as data:
                results = data.get(
                    [good, bare, forged, other_slot], [bytearray(location.size_bytes) for _ in range(4)]
                )
                assert [x.status for x in results] == ["ok", "unauthorized", "unauthorized", "unauthorized"]
                arena = data.map_info().arena_path  # only the segment's OS user may map it
                assert os.stat(arena).st_mode & 0o777 == 0o600
                grants = data.pin_local([bare, good])
                assert [g.status for g in grants.grants] == ["unauthorized", "ok"]
                data.unpin_local(grants.grant_id)
                # past the token's expiry and the segment's clock skew tolerance
                late_ms = r.read_expires_ms + CLOCK_SKEW_TOLERANCE_MS_DEFAULT - time.time() * 1000
                time.sleep(max(0.0, late_ms / 1000) + 0.1)
                expired = data.get([good], [bytearray(location.size_bytes)])
                assert [x.status for x in expired] == ["unauthorized"]
            brief.release(hit)


def test_replies_go_only_to_the_tenants_own_inbox(secure: Secure) -> None:
    """NATS checks the subject a tenant publishes to, not the reply subject it attaches: a tenant
    request naming any other reply subject (events, another tenant's inbox, a JetStream API
    subject) is dropped unanswered, so a tenant cannot make the directory publish for it. The
    shard map (a plain subscription every instance answers) keeps the same rule."""

    async def run() -> list[str]:
        admin = await secure.connect(nats_auth_from_env(secure.env("admin")))
        bob = await secure.connect(secure.tenant_auth("bob"))
        seen: list[str] = []
        try:
            targets = ["kvf.v1.events.directory.forged", "_INBOX.t.alice.stolen", "$JS.API.STREAM.INFO.X"]

            async def record(msg: Msg) -> None:
                seen.append(msg.subject)

            for target in targets:
                await admin.subscribe(target, cb=record)
            await admin.flush()
            lookup = encode(m.Lookup(holder_id="bob", groups=[]))  # no key: shard 0
            instance = (await directory_router(bob, "bob")).routes[0].instance
            subject = tenant_instance_subject(Service.DIRECTORY, "bob", "lookup", instance)
            shard_map = tenant_subject(Service.DIRECTORY, "bob", "shard_map")  # every instance answers
            for target in targets:
                await bob.publish(subject, lookup, reply=target)
                await bob.publish(shard_map, encode(m.GetShardMap()), reply=target)
            await bob.flush()
            await asyncio.sleep(0.5)
            reply = await as_tenant(bob, "bob", "lookup", m.Lookup(holder_id="bob", groups=[]))
            assert isinstance(reply, m.LookupReply)  # his own inbox still works
            return seen
        finally:
            await bob.close()
            await admin.close()

    assert asyncio.run(run()) == []


def test_a_tenant_flooding_the_shard_map_gets_no_answers_past_its_rate(secure: Secure) -> None:
    """`shard_map` bypasses the cores (and their per-domain rate limits): the instance answers a
    tenant at most SHARD_MAP_TENANT_PER_S times a second (burst as many), then stays silent, and
    answers again once the bucket refills."""
    flood = 4 * int(SHARD_MAP_TENANT_PER_S)

    async def run() -> tuple[int, float, msgspec.Struct]:
        bob = await secure.connect(secure.tenant_auth("bob"))
        try:
            inbox = bob.new_inbox()
            answers = 0

            async def count(msg: Msg) -> None:
                nonlocal answers
                answers += 1

            await bob.subscribe(inbox, cb=count)
            subject = tenant_subject(Service.DIRECTORY, "bob", "shard_map")
            started = time.monotonic()
            for _ in range(flood):
                await bob.publish(subject, encode(m.GetShardMap()), reply=inbox)
            await bob.flush()
            elapsed = time.monotonic() - started
            await asyncio.sleep(0.3)
            got = answers
            await asyncio.sleep(0.5)  # refilled: his router finds the map again
            reply = await as_tenant(bob, "bob", "lookup", m.Lookup(holder_id="bob", groups=[]))
            return got, elapsed, reply
        finally:
            await bob.close()

    got, elapsed, reply = asyncio.run(run())
    assert 1 <= got <= SHARD_MAP_TENANT_PER_S * (1 + elapsed + 0.3) + 1 < flood, (got, elapsed)
    assert isinstance(reply, m.LookupReply)


def test_requests_that_name_no_key_are_rate_limited_by_the_tenants_home_domain(tmp_path: Path) -> None:
    """Listing and showing name no key, so the core cannot charge a domain for them: the shell
    charges the tenant's own domain, and its rate limit holds for them too."""
    doc = write_auth(tmp_path / "auth", plan_auth(["alice", "bob"]), tls=True)
    bob_home = doc["grants"]["bob"][0]
    # 0.1/s: the three requests fall within one refill (10 s) however slow the host.
    quotas = json.dumps({bob_home: {"requests_per_s": 0.1, "burst": 2}})
    with NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server:
        secure = Secure(server, doc)
        with directory_process(server, **secure.env("svc-directory"), KVF_DIRECTORY_TENANT_QUOTAS=quotas):

            async def run() -> list[str]:
                nc = await nats.connect(server.url, **secure.tenant_auth("bob").connect_options())
                outcomes = []
                try:
                    for _ in range(3):
                        try:
                            await as_tenant(
                                nc,
                                "bob",
                                "list_groups",
                                m.ListGroups(domain_digest=DomainDigest(bytes.fromhex(bob_home))),
                            )
                            outcomes.append("ok")
                        except RateLimited:
                            outcomes.append("rate_limited")
                    release = m.LeaseRelease(holder_id="b", lease_id=1)
                    with pytest.raises(NotFound):  # releases are never refused for the rate
                        await as_tenant(nc, "bob", "lease_release", release)
                finally:
                    await nc.close()
                return outcomes

            assert asyncio.run(run()) == ["ok", "ok", "rate_limited"]


def test_one_tenant_holds_at_most_a_quarter_of_the_inflight_slots(tmp_path: Path) -> None:
    """Padded lookups hold their slot for the pad: bob floods the directory with 40 at once and
    gets at most a quarter of its 64 slots (the rest `busy`), while alice is served meanwhile."""
    doc = write_auth(tmp_path / "auth", plan_auth(["alice", "bob"]), tls=True)
    with NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server:
        secure = Secure(server, doc)
        with directory_process(
            server, **secure.env("svc-directory"), KVF_DIRECTORY_LOOKUP_REPLY_MIN_MS="400"
        ):

            async def run() -> tuple[list[str], bool]:
                bob = await nats.connect(server.url, **secure.tenant_auth("bob").connect_options())
                alice = await nats.connect(server.url, **secure.tenant_auth("alice").connect_options())

                async def one(router: DirectoryRouter) -> str:
                    try:
                        await ask_directory(router, "lookup", m.Lookup(holder_id="h", groups=[]))
                        return "ok"
                    except Busy:
                        return "busy"

                try:
                    bob_router = await directory_router(bob, "bob")
                    alice_router = await directory_router(alice, "alice")
                    flood = [asyncio.create_task(one(bob_router)) for _ in range(40)]
                    await asyncio.sleep(0.1)
                    served = await one(alice_router) == "ok"
                    outcomes = list(await asyncio.gather(*flood))
                    # Every slot came back (nothing leaked): a full share is served again.
                    again = await asyncio.gather(*(one(bob_router) for _ in range(16)))
                    assert again == ["ok"] * 16
                    return outcomes, served
                finally:
                    await bob.close()
                    await alice.close()

            outcomes, alice_served = asyncio.run(run())
            assert outcomes.count("ok") == 16 and outcomes.count("busy") == 24
            assert alice_served


def test_a_tenants_long_prefix_hits_through_fair_admission(tmp_path: Path) -> None:
    """A tenant's lookup of more than 128 groups of one shard is answered in slices with its
    objects already encoded; the fair gate's charge for the replicas answered read them as
    Structs and raised: every such lookup answered `internal`, a miss (the corrupted-byte
    drill's 10,000-token prompts on a one-shard local cluster; CI, 2026-12-06). The
    service-plane tests never pass the fair gate."""
    doc = write_auth(tmp_path / "auth", plan_auth(["alice"], {}), tls=True)
    chunks = 160  # more than LOOKUP_SLICE_GROUPS (128), all on the one shard
    tokens = prompt(chunks * TOKENS_PER_CHUNK, seed=77)
    with (
        NatsServer(tmp_path / "nats", extra_args=["-c", doc["conf"]]) as server,
        directory_process(server, KVF_DIRECTORY_SHARDS="1", **Secure(server, doc).env("svc-directory")),
        segment_process(server, "seg-t", 256 << 20, **Secure(server, doc).env("svc-segment")),
        Secure(server, doc).client("alice") as alice,
    ):
        saved = alice.save(tokens, objects_for(tokens, 0, chunks))
        assert saved.chunks_saved == chunks, saved
        hit = alice.lookup(tokens)
        try:
            assert hit.chunks == chunks and hit.cause == "", hit.cause
        finally:
            alice.release(hit)

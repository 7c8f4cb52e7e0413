"""Issue 21 rows 9 and 2 at the directory shell and host, without NATS: a tenant's `show_group`
of another tenant's group is refused before the core is called (so an existing group and a
missing one cost the same: the same code runs); a `lookup_many` reply fits NATS's max payload
whatever its parts hit; every core call is timed (the event-loop stall metric)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest

from kvfabric.core import authz
from kvfabric.core.directory import DirectoryConfig, DirectoryCore, Outcome
from kvfabric.directory.metrics import DirectoryCollector
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.shell import LOOKUP_SLICE_GROUPS, DirectoryShell
from kvfabric.directory.stalls import CORE_CALLS
from kvfabric.format.errors import KvfError
from kvfabric.format.ids import GroupId, pack_object_key
from kvfabric.format.key import ShareDomain, chunk_groups_for_prefix
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.shards import shard_of
from tests.unit.core.dirkit import MODEL, SECRET, confirm_all, layout, spec

ALICE = ShareDomain(tenant_id="alice", salt=b"a" * 16)
BOB = ShareDomain(tenant_id="bob", salt=b"b" * 16)
PUB = ShareDomain(tenant_id="pub", salt=b"p" * 16)
GRANTS = {
    "alice": authz.TenantGrant("alice", frozenset({ALICE.digest()}), home=ALICE.digest()),
    "bob": authz.TenantGrant("bob", frozenset({BOB.digest()}), home=BOB.digest()),
    "carol": authz.TenantGrant("carol", frozenset({BOB.digest(), PUB.digest()}), home=BOB.digest()),
}


def ids(domain: ShareDomain, n: int, seed: int = 0) -> list[GroupId]:
    tokens = [seed * 100_000 + i for i in range(4 * n)]
    return [g.group_id() for g in chunk_groups_for_prefix(domain, MODEL, layout(), tokens)]


def publish(core: DirectoryCore, groups: list[GroupId], batch: int = 128) -> None:
    for start in range(0, len(groups), batch):
        keys = [pack_object_key(g, 0, 0, 0) for g in groups[start : start + batch]]  # member (0, 0, 0)
        begin = core.handle(
            m.PutBegin(writer_id="w", request_id=f"b{start}{keys[0].hex()}", objects=[spec(k) for k in keys]),
            0,
        ).reply
        assert isinstance(begin, m.PutBeginReply)
        assert {r.status for r in begin.results} == {"placed"}
        confirm_all(core, begin, 0, slot_base=start)
        core.handle(m.PutCommit(writer_id="w", request_id=f"c{start}{keys[0].hex()}", keys=keys), 0)


def new_core(segments: int = 1, shard: int = 0, **config: Any) -> DirectoryCore:
    core = DirectoryCore(DirectoryConfig(ticket_secret=SECRET, **config), shard=shard)
    for i in range(segments):
        core.handle(
            m.RegisterSegment(
                segment_id=f"segment-{i:02d}",
                incarnation=1,
                capacity_bytes=1 << 40,
                domain=m.FailureDomain(host=f"host-{i}", zone=f"zone-{i}"),
                data_addr=f"tcp://10.0.0.{i}:40000 ucx://10.0.0.{i}:40001",
            ),
            0,
        )
    return core


def shell_of(core: DirectoryCore) -> DirectoryShell:
    return DirectoryShell(core, tick_ms=100, events_outbox_max=1_000, events_max_age_s=60, free_timeout_s=1)


class Spy:
    """Counts the core's `handle` calls (and passes them on)."""

    def __init__(self, core: DirectoryCore) -> None:
        self.calls: list[msgspec.Struct] = []
        self._handle = core.handle

    def __call__(self, request: msgspec.Struct, now_ms: int, **kwargs: Any) -> Outcome:
        self.calls.append(request)
        return self._handle(request, now_ms, **kwargs)


async def refusal(shell: DirectoryShell, tenant: str, group: bytes) -> KvfError:
    with pytest.raises(KvfError) as caught:
        await shell.handle_tenant(m.ShowGroup(group=group), "show_group", GRANTS[tenant])
    return caught.value


def test_show_group_of_another_tenants_group_never_reaches_the_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 9: bob's show_group of alice's real group (by id or key) and of a missing id of
    alice's is answered before the core is called, with a missing group's NotFound; before,
    the core built the real group's summary first (+31.6 us: separable by timing)."""
    core = new_core()
    real, missing = ids(ALICE, 2, seed=1)
    publish(core, [real])
    shell = shell_of(core)
    spy = Spy(core)
    monkeypatch.setattr(core, "handle", spy)

    async def go() -> None:
        alice_key = real[4:20] + real[58:90]
        errors = [
            await refusal(shell, "bob", g) for g in (real, alice_key, missing, missing[4:20] + missing[58:90])
        ]
        assert spy.calls == []  # no work that depends on alice's group
        assert {(e.code, e.message) for e in errors} == {("not_found", "no such chunk group")}
        assert [e.details["group"] for e in errors] == [g[-32:].hex() for g in (real, real, missing, missing)]
        # the same answer bob gets for a missing group of his own (from the core)
        own_missing = await refusal(shell, "bob", ids(BOB, 1, seed=2)[0])
        assert (own_missing.code, own_missing.message) == ("not_found", "no such chunk group")
        assert len(spy.calls) == 1
        # alice sees her own group by id, key, and chain hash alone (her one domain)
        for g in (real, alice_key, real[58:90]):
            shown = await shell.handle_tenant(m.ShowGroup(group=g), "show_group", GRANTS["alice"])
            assert isinstance(shown, m.GroupList) and [s.namespace for s in shown.groups] == [real[:54]]
        # bob's chain hash alone means his own domain: alice's chain hash is not found there
        assert (await refusal(shell, "bob", real[58:90])).code == "not_found"
        # a chain hash alone is looked up under each of the tenant's domains, never another's
        shared = ids(PUB, 1, seed=5)[0]
        publish(core, [shared])
        spy.calls.clear()
        assert (await refusal(shell, "carol", real[58:90])).code == "not_found"
        asked = sorted(cast(m.ShowGroup, c).group for c in spy.calls)
        assert asked == sorted(d + real[58:90] for d in GRANTS["carol"].domains)
        shown = await shell.handle_tenant(m.ShowGroup(group=shared[58:90]), "show_group", GRANTS["carol"])
        assert isinstance(shown, m.GroupList) and [s.namespace for s in shown.groups] == [shared[:54]]

    asyncio.run(go())


def test_a_lookup_many_reply_fits_the_max_payload_whatever_its_parts_hit() -> None:
    """Two shards' parts of 1,200 groups each, 3 replicas with two addresses each: each part
    alone fits, together ~1.4 MiB (NATS drops such a reply, the leases stay). The reply now
    fits: the second part's hit is cut short at its fold, the first part whole."""
    host = ShardHost(
        "dir-a",
        2,
        DirectoryConfig(ticket_secret=SECRET),
        registry=cast(Any, None),
        make_shell=cast(Any, None),
    )
    by_shard: dict[int, list[GroupId]] = {0: [], 1: []}
    for g in ids(ALICE, 3_000, seed=3):
        shard = shard_of(g, 2)
        if len(by_shard[shard]) < 1_200:
            by_shard[shard].append(g)
    for shard, groups in by_shard.items():
        core = new_core(segments=3, shard=shard, replicas_default=3)
        publish(core, groups, batch=64)
        host.shells[shard] = shell_of(core)
    request = m.LookupMany(
        holder_id="h", parts=[m.LookupPart(shard=s, groups=gs) for s, gs in sorted(by_shard.items())]
    )

    reply = asyncio.run(host.lookup_many(request, GRANTS["alice"]))
    size = len(encode(reply))
    assert size <= m.REPLY_BYTES_MAX, size
    hits = [p.reply.hit_chunks if p.reply else -1 for p in reply.parts]
    assert hits[0] == 1_200 and 0 < hits[1] < 1_200, hits
    assert size > m.REPLY_BYTES_MAX - 64 * 1024  # cut near the limit, not far below it


def test_every_core_call_is_timed_and_exported() -> None:
    core = new_core()
    shell = shell_of(core)
    before = CORE_CALLS.count
    CORE_CALLS.take_longest()

    async def go() -> None:
        await shell.handle(m.ListSegments())
        await shell.handle_tenant(m.ListGroups(), "list_groups", GRANTS["alice"])  # charge + core

    asyncio.run(go())
    assert CORE_CALLS.count == before + 3
    metrics = {f.name: f for f in DirectoryCollector(cast(Any, None))._core_calls()}
    histogram = metrics["kvfabric_directory_core_call_seconds"]
    assert {s.name for s in histogram.samples} >= {
        "kvfabric_directory_core_call_seconds_bucket",
        "kvfabric_directory_core_call_seconds_sum",
    }
    inf = [s for s in histogram.samples if s.labels.get("le") == "+Inf"]
    assert inf[0].value == CORE_CALLS.count
    longest = metrics["kvfabric_directory_core_call_longest_seconds"].samples[0].value
    assert 0 < longest < 1
    assert CORE_CALLS.take_longest() == (0.0, "")  # the scrape took it


def test_a_long_lookup_runs_in_slices_and_others_run_between() -> None:
    """Row 2: a 1,000-group lookup is folded LOOKUP_SLICE_GROUPS groups a core call, the event
    loop yielded between: a request that arrives meanwhile runs after one slice, not after the
    whole lookup. What it does can only shorten the hit: here an eviction of group 200 (not
    leased yet) ends the fold there, while evicting group 5 (already leased) is refused."""
    core = new_core()
    groups = ids(ALICE, 1_000, seed=4)
    publish(core, groups)
    shell = shell_of(core)
    request = m.Lookup(holder_id="h", groups=groups)
    before = CORE_CALLS.count
    evicted: list[m.EvictReply] = []

    async def evict() -> None:
        reply = await shell.handle(m.Evict(groups=[groups[5], groups[200]], reason="test"))
        assert isinstance(reply, m.EvictReply)
        evicted.append(reply)

    async def go() -> m.LookupReply:
        whole = await shell.handle(request)  # nothing else running: every slice hits
        assert isinstance(whole, m.LookupReply) and whole.hit_chunks == 1_000
        await shell.handle(m.LeaseRelease(holder_id="h", lease_id=whole.lease_id))
        task = asyncio.create_task(evict())  # runs at the lookup's first yield
        reply = await shell.handle(request)
        await task
        assert isinstance(reply, m.LookupReply)
        return reply

    reply = asyncio.run(go())
    assert [r.status for r in evicted[0].results] == ["leased", "evicting"]
    assert reply.hit_chunks == 200
    assert len(reply.objects) == 200
    assert core._leases[reply.lease_id].groups == tuple(g[4:20] + g[58:90] for g in groups[:200])
    slices = -(-1_000 // LOOKUP_SLICE_GROUPS) + 2  # the whole one; then a slice and a short one
    assert CORE_CALLS.count - before == slices + 2  # and the release, the eviction
    core.check_invariants()

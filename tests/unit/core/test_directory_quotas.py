"""Per-tenant quotas and request rates in the directory core: short scripts, time passed in."""

from __future__ import annotations

from typing import Any

import pytest

from kvfabric.core.directory import DirectoryConfig, DirectoryCore, FreeSlots
from kvfabric.core.quotas import Quotas, TenantQuota, tenant_of
from kvfabric.format.errors import Busy, RateLimited
from kvfabric.format.ids import ObjectKey
from kvfabric.format.key import ChunkGroupId, ShareDomain, chunk_groups_for_prefix
from kvfabric.proto import directory as m

from .dirkit import (
    DOMAIN,
    MODEL,
    SECRET,
    confirm_all,
    groups,
    key,
    layout,
    lookup,
    one_group_and_a_copy_target,
    put,
    register,
    spec,
)

OTHER = ShareDomain(tenant_id="tenant-b", salt=b"o" * 16)
A = DOMAIN.digest()
B = OTHER.digest()


def groups_b(n_chunks: int, seed: int = 0) -> list[ChunkGroupId]:
    tokens = [seed * 1000 + i for i in range(4 * n_chunks)]
    return chunk_groups_for_prefix(OTHER, MODEL, layout(), tokens)


def core_with(quota_a: TenantQuota, default: TenantQuota | None = None, **kw: Any) -> DirectoryCore:
    config = DirectoryConfig(
        ticket_secret=SECRET,
        tenant_quotas={A: quota_a},
        tenant_quota_default=default or TenantQuota(),
        **kw,
    )
    return DirectoryCore(config)


def begin(
    core: DirectoryCore, keys: list[ObjectKey], now: int = 0, rid: str = "r", size: int = 100
) -> m.PutBeginReply:
    reply = core.handle(
        m.PutBegin(writer_id="w", request_id=rid, objects=[spec(k, size) for k in keys]), now
    ).reply
    assert isinstance(reply, m.PutBeginReply)
    return reply


def usage(core: DirectoryCore, digest: bytes) -> tuple[int, int]:
    use = core.quotas.usage.get(tenant_of(bytes(4) + digest))
    return (use.bytes, use.objects) if use else (0, 0)


def test_tenant_is_the_domain_digest_of_keys_groups_and_namespaces() -> None:
    (g,) = groups(1)
    assert tenant_of(key(g)) == tenant_of(g.to_bytes()) == tenant_of(g.to_bytes()[:54]) == A


def test_bytes_quota_holds_across_a_batch_and_spares_other_tenants() -> None:
    core = core_with(TenantQuota(bytes_max=500), replicas_default=2)
    register(core, "s1")
    register(core, "s2")
    keys = [key(g) for g in groups(4)]
    results = begin(core, keys).results  # 100 B x 2 replicas each: two fit in 500 B
    assert [r.status for r in results] == ["placed", "placed", "quota_exceeded", "quota_exceeded"]
    assert usage(core, A) == (400, 2)
    assert not results[2].tickets
    other = begin(core, [key(g) for g in groups_b(4)], rid="b").results  # B has no quota
    assert {r.status for r in other} == {"placed"}
    assert usage(core, B) == (800, 4)
    assert core.counters["quota_exceeded_objects_total"] == 2
    assert core.quotas.stats[tenant_of(keys[0])].quota_exceeded == 2
    core.check_invariants()


def test_objects_quota_counts_members_and_freeing_gives_room_back() -> None:
    core = core_with(TenantQuota(objects_max=2))
    register(core, "s1")
    gs = groups(3)
    assert [r.status for r in put(core, [key(gs[0]), key(gs[1])]).results] == ["published", "published"]
    assert begin(core, [key(gs[2])], rid="x").results[0].status == "quota_exceeded"
    evicted = core.handle(m.Evict(groups=[gs[0].group_id()]), 10)
    assert usage(core, A) == (200, 1)  # the object is gone, its bytes are held until freed
    assert begin(core, [key(gs[2])], now=10, rid="y").results[0].status == "placed"
    (free,) = [e for e in evicted.effects if isinstance(e, FreeSlots)]
    core.handle(m.SlotsFreed(segment_id="s1", incarnation=1, freed=list(free.slots)), 20)
    assert usage(core, A) == (200, 2)
    core.check_invariants()


def test_bytes_come_back_on_abort_on_expiry_and_when_a_segment_dies() -> None:
    core = core_with(TenantQuota(bytes_max=300))
    register(core, "s1")
    gs = groups(4)
    first = begin(core, [key(gs[0]), key(gs[1]), key(gs[2])])
    assert usage(core, A) == (300, 3)
    assert begin(core, [key(gs[3])], rid="2").results[0].status == "quota_exceeded"
    core.handle(m.PutAbort(writer_id="w", request_id="a", keys=[key(gs[0])]), 1)
    assert usage(core, A) == (200, 2)
    confirm_all(core, first, 2)  # confirmed slots of a dead writer are held until freed
    core.tick(40_000)  # write deadlines (30 s) passed; the segment is silent too: down
    assert usage(core, A) == (0, 0)
    register(core, "s1", now=40_000, incarnation=2)
    assert begin(core, [key(gs[3])], now=40_000, rid="3").results[0].status == "placed"
    core.check_invariants()


def test_rate_limit_answers_rate_limited_with_retry_after_from_passed_in_time() -> None:
    core = core_with(TenantQuota(requests_per_s=10, burst=2))
    register(core, "s1")
    (ga,) = groups(1)
    (gb,) = groups_b(1)
    lookup(core, [ga], now=1000)
    lookup(core, [ga], now=1000)
    with pytest.raises(RateLimited) as caught:
        lookup(core, [ga], now=1000)
    assert caught.value.retry_after_ms == 100 and caught.value.retryable
    assert caught.value.details["retry_after_ms"] == 100
    with pytest.raises(RateLimited):  # a refused request takes no token and applies nothing
        begin(core, [key(ga)], now=1050)
    assert usage(core, A) == (0, 0)
    for _ in range(5):
        lookup(core, [gb], now=1050)  # another tenant: not limited
    lookup(core, [ga], now=1100)  # one token back after 100 ms
    with pytest.raises(RateLimited) as again:
        core.handle(m.PutCommit(writer_id="w", request_id="c", keys=[key(ga)]), 1120)
    assert again.value.retry_after_ms == 80
    assert core.quotas.stats[tenant_of(key(ga))].rate_limited == 3
    assert core.counters["error_rate_limited_total"] == 3
    # evict (the policy's) and tool queries are never charged
    core.handle(m.Evict(groups=[ga.group_id()]), 1120)
    listed = core.handle(m.ListTenants(), 1120).reply
    assert isinstance(listed, m.TenantList)
    (row,) = [t for t in listed.tenants if t.domain_digest == A]
    assert (row.requests_per_s, row.burst, row.rate_limited) == (10, 2, 3)
    core.check_invariants()


def test_retried_begin_gets_its_first_answer_without_a_token() -> None:
    core = core_with(TenantQuota(requests_per_s=1, burst=1))
    register(core, "s1")
    (g,) = groups(1)
    first = begin(core, [key(g)], now=0)
    assert begin(core, [key(g)], now=0) == first  # same request id: the cached reply


def test_a_begin_refused_busy_takes_no_token() -> None:
    # A writer that backs off on busy and asks again (kvfabric.client.busy) must not spend the
    # tenant's request budget on refusals: the busy check comes before the rate charge.
    core = core_with(TenantQuota(requests_per_s=1, burst=1), pending_objects_max=1)
    register(core, "s1")
    g1, g2 = groups(2)
    with pytest.raises(Busy):
        begin(core, [key(g1), key(g2)], now=0)  # two objects over a bound of one
    for _ in range(3):
        with pytest.raises(Busy):
            begin(core, [key(g1), key(g2)], now=0, rid="again")
    assert begin(core, [key(g1)], now=0, rid="fits").results[0].status == "placed"  # the token is there


def test_list_tenants_shows_usage_against_limits_and_the_default() -> None:
    core = core_with(TenantQuota(bytes_max=1000, objects_max=5), default=TenantQuota(bytes_max=50))
    register(core, "s1")
    put(core, [key(groups(1)[0])])
    assert begin(core, [key(groups_b(1)[0])], rid="b").results[0].status == "quota_exceeded"
    listed = core.handle(m.ListTenants(limit=10), 0).reply
    assert isinstance(listed, m.TenantList)
    rows = {t.domain_digest: t for t in listed.tenants}
    assert (rows[A].used_bytes, rows[A].objects, rows[A].bytes_max, rows[A].objects_max) == (100, 1, 1000, 5)
    assert (rows[B].used_bytes, rows[B].bytes_max, rows[B].quota_exceeded) == (0, 50, 1)
    assert listed.default is not None and listed.default.bytes_max == 50


def test_tenant_table_is_bounded_least_recently_used_first() -> None:
    quotas = Quotas(TenantQuota(requests_per_s=1), {}, tenants_max=2, count=lambda name, n: None)
    tenants = [tenant_of(bytes(4) + bytes([i]) * 16) for i in range(3)]
    for t in tenants:
        assert quotas.charge([t], 0) == 0
    assert list(quotas.stats) == tenants[1:]
    assert quotas.charge([tenants[2]], 0) == 1000  # its bucket is remembered: empty


def test_extra_replicas_count_until_confirmed_or_expired() -> None:
    core = core_with(TenantQuota(bytes_max=150))
    g, other = one_group_and_a_copy_target(core)
    reply = core.handle(
        m.ReplicateBegin(writer_id="repair", request_id="1", key=key(g), segment_id=other), 0
    ).reply
    assert isinstance(reply, m.ReplicateBeginReply) and reply.status == "placed"  # never refused
    assert usage(core, A) == (200, 1)
    core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), 40_000)
    core.handle(m.Heartbeat(segment_id="s2", incarnation=1, used_bytes=0), 40_000)
    core.tick(40_000)  # the copy ticket expired unconfirmed
    assert usage(core, A) == (100, 1)
    core.check_invariants()


def test_a_tenant_out_of_tokens_is_refused_before_its_keys_are_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A put_begin or put_commit of a tenant whose bucket is empty was refused only after each
    of its keys was parsed and checked (~14 ms of the shard's loop for 1,900 keys, the shared key
    cache filled with keys never used): the request quota did not bound the tenant's directory
    work (review, stop 68). Now the bucket is read first; a new tenant's is full."""
    from kvfabric.core.directory import writes as writes_module
    from kvfabric.core.directory import writes_begin as begin_module

    core = core_with(TenantQuota(requests_per_s=1, burst=1))
    register(core, "s1")
    ga = groups(8)
    assert begin(core, [key(ga[0])], now=1000).results[0].status == "placed"  # a new tenant: full
    parsed: list[bytes] = []
    real = begin_module.parse_key  # type: ignore[attr-defined]

    def counting(raw: bytes) -> Any:
        parsed.append(raw)
        return real(raw)

    monkeypatch.setattr(begin_module, "parse_key", counting)
    monkeypatch.setattr(writes_module, "parse_key", counting)
    fresh = [key(g) for g in ga[1:]]
    with pytest.raises(RateLimited) as refused:
        begin(core, fresh, now=1100, rid="r2")
    with pytest.raises(RateLimited):
        core.handle(m.PutCommit(writer_id="w", request_id="c", keys=fresh), 1100)
    assert parsed == [] and refused.value.retry_after_ms == 900
    assert core.quotas.stats[tenant_of(key(ga[0]))].rate_limited == 2
    assert begin(core, [key(ga[1])], now=2000, rid="r3").results[0].status == "placed"  # refilled
    core.check_invariants()

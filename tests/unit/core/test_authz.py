"""`kvfabric.core.authz`: what a tenant's request becomes before the directory core sees it, and
the core's own refusal of forged identities (a known chain hash under another domain's digest)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.core.authz import TENANT_VERBS, TenantGrant, authorize, check_visible, merge_evict_results
from kvfabric.format.errors import BadRequest, Busy, NotFound, Unauthorized
from kvfabric.format.ids import GroupId, ObjectKey, chain_in_id, group_id_in_key, namespace_in_id
from kvfabric.format.key import ShareDomain, chunk_groups_for_prefix
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import MODEL, key, layout, new_core, put, register, spec

DOMAINS = [ShareDomain(tenant_id=f"d{i}", salt=bytes([65 + i]) * 16) for i in range(3)]
DIGESTS = [d.digest() for d in DOMAINS]
GROUPS = {
    i: [g.group_id() for g in chunk_groups_for_prefix(d, MODEL, layout(), list(range(i, i + 12)))]
    for i, d in enumerate(DOMAINS)
}
ALICE = TenantGrant(tenant="alice", domains=frozenset({DIGESTS[0], DIGESTS[2]}))  # d2 is shared

group_lists = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 2)).map(lambda t: GROUPS[t[0]][t[1]]), max_size=8
)


@settings(max_examples=200)
@given(groups=group_lists, holder=st.text(min_size=1, max_size=20))
def test_lookup_keeps_the_granted_prefix_and_scopes_the_holder(groups: list[GroupId], holder: str) -> None:
    out = authorize(m.Lookup(holder_id=holder, groups=groups), "lookup", ALICE)
    assert isinstance(out, m.Lookup)
    assert out.groups == groups[: len(out.groups)]  # a prefix: the fold never skips a gap
    assert all(ALICE.owns(g) for g in out.groups)
    if len(out.groups) < len(groups):
        assert not ALICE.owns(groups[len(out.groups)])  # cut exactly at the first foreign group
    assert out.holder_id == f"alice/{holder}"


@settings(max_examples=200)
@given(groups=group_lists)
def test_pin_and_evict_see_only_granted_groups(groups: list[GroupId]) -> None:
    pin = authorize(m.Pin(holder_id="h", groups=groups, ttl_ms=1), "pin", ALICE)
    assert isinstance(pin, m.Pin) and pin.groups == [g for g in groups if ALICE.owns(g)]
    evict = authorize(m.Evict(groups=groups), "evict", ALICE)
    assert isinstance(evict, m.Evict) and evict.groups == [g for g in groups if ALICE.owns(g)]
    core_reply = m.EvictReply(
        epoch=3, results=[m.EvictResult(group=g, status="evicting") for g in evict.groups]
    )
    merged = merge_evict_results(groups, core_reply, ALICE)
    assert [r.group for r in merged.results] == groups
    assert all(r.status == ("evicting" if ALICE.owns(r.group) else "not_found") for r in merged.results)
    # each group's tails (the one before it), renumbered to the groups kept: foreign ones drop
    chained = authorize(
        m.Evict(groups=groups, tails=[[i - 1] if i else [] for i in range(len(groups))]), "evict", ALICE
    )
    assert isinstance(chained, m.Evict) and len(chained.tails) == len(chained.groups)
    kept = [i for i, g in enumerate(groups) if ALICE.owns(g)]
    for new, old in enumerate(kept):
        expected = [kept.index(old - 1)] if old and old - 1 in kept else []
        assert chained.tails[new] == expected


def test_writes_with_a_foreign_key_are_refused_whole() -> None:
    own, foreign = key_of(0), key_of(1)
    with pytest.raises(Unauthorized):
        authorize(
            m.PutBegin(writer_id="w", request_id="r", objects=[spec(own), spec(foreign)]), "put_begin", ALICE
        )
    for kind, verb in ((m.PutCommit, "put_commit"), (m.PutAbort, "put_abort")):
        with pytest.raises(Unauthorized):
            authorize(kind(writer_id="w", request_id="r", keys=[own, foreign]), verb, ALICE)
        ok = authorize(kind(writer_id="w", request_id="r", keys=[own]), verb, ALICE)
        assert isinstance(ok, m.PutCommit | m.PutAbort) and ok.writer_id == "alice/w"


@pytest.mark.parametrize(
    ("verb", "message"),
    [
        ("register", m.ListSegments()),
        ("list_leases", m.ListLeases()),
        ("list_tenants", m.ListTenants()),
        ("replica_corrupt", m.ListSegments()),
    ],
)
def test_service_verbs_are_refused(verb: str, message: m.DirectoryRequest) -> None:
    assert verb not in TENANT_VERBS
    with pytest.raises(Unauthorized):
        authorize(message, verb, ALICE)


def test_listing_needs_a_granted_domain() -> None:
    with pytest.raises(BadRequest):  # alice has two domains: she must name one
        authorize(m.ListGroups(), "list_groups", ALICE)
    solo = TenantGrant(tenant="bob", domains=frozenset({DIGESTS[1]}))
    out = authorize(m.ListGroups(), "list_groups", solo)
    assert isinstance(out, m.ListGroups) and out.domain_digest == DIGESTS[1]


def test_show_group_outside_the_grant_is_not_found() -> None:
    summary = m.GroupSummary(
        group=chain_in_id(GROUPS[1][0]),
        namespace=namespace_in_id(GROUPS[1][0]),
        chunk_index=0,
        state="published",
        members=1,
        expected_members=1,
    )
    with pytest.raises(NotFound, match="no such chunk group"):
        check_visible(m.GroupList(epoch=1, groups=[summary]), ALICE, GROUPS[1][0])


def key_of(domain: int) -> ObjectKey:
    groups = chunk_groups_for_prefix(DOMAINS[domain], MODEL, layout(), [1, 2, 3, 4])
    return key(groups[0])


def test_core_treats_a_forged_domain_digest_like_a_missing_group() -> None:
    """A tenant that learned another's chain hash and writes its own digest over the domain bytes
    gets exactly the answers of a missing group from pin, evict and show_group (lookup already)."""
    core = new_core()
    register(core, "s1")
    groups = chunk_groups_for_prefix(DOMAINS[0], MODEL, layout(), [1, 2, 3, 4])
    real = groups[0].to_bytes()
    assert put(core, [key(groups[0])]).results[0].status == "published"
    forged = GroupId(real[:4] + DIGESTS[1] + real[20:])
    pin = core.handle(m.Pin(holder_id="x", groups=[forged], ttl_ms=1000), 0).reply
    assert isinstance(pin, m.PinReply) and pin.pinned_groups == 0
    evicted = core.handle(m.Evict(groups=[forged]), 0).reply
    assert isinstance(evicted, m.EvictReply) and evicted.results[0].status == "not_found"
    with pytest.raises(NotFound):
        core.handle(m.ShowGroup(group=forged), 0)
    looked = core.handle(m.Lookup(holder_id="x", groups=[forged]), 0).reply
    assert isinstance(looked, m.LookupReply) and looked.hit_chunks == 0
    shown = core.handle(m.ShowGroup(group=real), 0).reply  # the real id still works
    assert isinstance(shown, m.GroupList) and len(shown.groups) == 1


def test_a_forged_domain_can_neither_claim_nor_probe_another_domains_chain_hash() -> None:
    """Groups are keyed by (domain digest, chain hash): bob writing his digest over alice's chain
    hash gets a group of his own — it cannot block alice's writes, shadow her reads, or tell
    (through put_commit or put_begin answers) whether alice's group exists."""
    core = new_core()
    register(core, "s1")
    alice_a, alice_b = chunk_groups_for_prefix(DOMAINS[0], MODEL, layout(), [1, 2, 3, 4, 5, 6, 7, 8])[:2]
    assert put(core, [key(alice_a)], writer="alice").results[0].status == "published"
    cached, absent = (ObjectKey(key(g)[:4] + DIGESTS[1] + key(g)[20:]) for g in (alice_a, alice_b))
    commits = [
        core.handle(m.PutCommit(writer_id="bob", request_id=f"c{i}", keys=[k]), 0).reply
        for i, k in enumerate((cached, absent))
    ]
    assert [c.results[0].status for c in commits if isinstance(c, m.PutCommitReply)] == ["not_found"] * 2
    begins = [
        core.handle(m.PutBegin(writer_id="bob", request_id=f"b{i}", objects=[spec(k)]), 0).reply
        for i, k in enumerate((cached, absent))
    ]
    assert [b.results[0].status for b in begins if isinstance(b, m.PutBeginReply)] == ["placed"] * 2

    # Bob claims the chain hash of alice's next chunk first: alice still writes and reads hers.
    core2 = new_core()
    register(core2, "s1")
    assert put(core2, [absent], writer="bob").results[0].status == "published"
    assert put(core2, [key(alice_b)], writer="alice", request_id="r2").results[0].status == "published"
    looked = core2.handle(m.Lookup(holder_id="a", groups=[alice_b.group_id()]), 0).reply
    assert isinstance(looked, m.LookupReply) and looked.hit_chunks == 1
    evicted = core2.handle(m.Evict(groups=[group_id_in_key(absent)]), 0).reply  # bob evicts only his own
    assert isinstance(evicted, m.EvictReply) and evicted.results[0].status == "evicting"
    looked = core2.handle(m.Lookup(holder_id="a", groups=[alice_b.group_id()]), 0).reply
    assert isinstance(looked, m.LookupReply) and looked.hit_chunks == 1  # alice's is untouched
    shown = core2.handle(m.ShowGroup(group=alice_b.to_bytes()[58:90]), 0).reply
    assert isinstance(shown, m.GroupList) and [s.namespace[4:20] for s in shown.groups] == [DIGESTS[0]]
    core.check_invariants()
    core2.check_invariants()


def test_every_tenant_request_but_a_release_costs_a_token_somewhere() -> None:
    from kvfabric.core.authz import charge_home

    own = GROUPS[0][:1]
    assert not charge_home("lookup", m.Lookup(holder_id="h", groups=own))  # the core charges own groups
    assert charge_home("lookup", m.Lookup(holder_id="h", groups=[]))  # all foreign: the home domain
    assert charge_home("pin", m.Pin(holder_id="h", groups=[], ttl_ms=1))
    charged: list[tuple[str, msgspec.Struct]] = [
        ("list_groups", m.ListGroups()),
        ("show_group", m.ShowGroup(group=own[0])),
        ("evict", m.Evict(groups=[])),
        ("lease_renew", m.LeaseRenew(holder_id="h", lease_id=1)),
    ]
    assert all(charge_home(verb, msg) for verb, msg in charged)
    released: list[tuple[str, msgspec.Struct]] = [
        ("lease_release", m.LeaseRelease(holder_id="h", lease_id=1)),
        ("unpin", m.Unpin(holder_id="h", pin_id=1)),
        ("put_abort", m.PutAbort(writer_id="w", request_id="r", keys=[])),
    ]
    assert not any(charge_home(verb, msg) for verb, msg in released)  # giving back is never refused


def test_one_tenant_cannot_fill_the_shared_lease_and_pin_tables() -> None:
    core = new_core(tenant_leases_max=2, tenant_pins_max=1)
    register(core, "s1")
    g = chunk_groups_for_prefix(DOMAINS[0], MODEL, layout(), [1, 2, 3, 4])[0]
    put(core, [key(g)])
    lookup = m.Lookup(holder_id="alice/engine", groups=[g.group_id()])
    leases = [core.handle(lookup, 0).reply for _ in range(2)]
    with pytest.raises(Busy):
        core.handle(lookup, 0)  # alice's share is full ...
    other = core.handle(m.Lookup(holder_id="bob/engine", groups=[g.group_id()]), 0).reply
    assert isinstance(other, m.LookupReply) and other.lease_id  # ... bob's is not
    first = leases[0]
    assert isinstance(first, m.LookupReply)
    core.handle(m.LeaseRelease(holder_id="alice/engine", lease_id=first.lease_id), 0)
    assert isinstance(core.handle(lookup, 0).reply, m.LookupReply)  # a release gives the slot back
    pin = m.Pin(holder_id="alice/engine", groups=[g.group_id()], ttl_ms=1000)
    core.handle(pin, 0)
    with pytest.raises(Busy):
        core.handle(pin, 0)
    core.check_invariants()


def test_a_tenants_leases_and_pins_name_at_most_their_share_of_groups() -> None:
    """Review, 2026-12-05: the per-tenant lease and pin bounds counted entries, not the groups
    they name (each a key held): 2,500 pins of 4,096 groups held ~0.9 GB. Past the groups bound
    a lease or pin is `busy`, and a lookup's later slice is not leased (a shorter hit); another
    tenant is not affected, and releasing gives the room back."""
    from kvfabric.core import authz
    from tests.unit.core.dirkit import groups as dir_groups
    from tests.unit.core.dirkit import key as dir_key
    from tests.unit.core.dirkit import put as dir_put
    from tests.unit.core.dirkit import register as dir_register

    core = new_core(tenant_lease_groups_max=6, tenant_pin_groups_max=4)
    dir_register(core, "s1", capacity=10**6)
    gs = dir_groups(8, seed=31)
    dir_put(core, [dir_key(g) for g in gs])
    ids = [g.group_id() for g in gs]
    bob = authz.scoped_name("bob", "h")
    first = core.handle(m.Lookup(holder_id=bob, groups=ids[:5]), 0).reply
    assert isinstance(first, m.LookupReply) and first.hit_chunks == 5
    with pytest.raises(Busy):  # 5 + 2 > 6
        core.handle(m.Lookup(holder_id=bob, groups=ids[:2]), 0)
    # a lookup run in slices: its first slice (1 group) is leased, the next would pass the bound
    second = core.handle(m.Lookup(holder_id=bob, groups=ids[:3]), 0, groups_max=1).reply
    assert isinstance(second, m.LookupReply) and second.hit_chunks == 1
    more = core.reads.lookup_more(
        m.Lookup(holder_id=bob, groups=ids[:3]), second.lease_id, 1, 0, reply_bytes_max=1 << 20, groups_max=2
    ).reply
    assert isinstance(more, m.LookupReply) and more.hit_chunks == 0
    alice = core.handle(m.Lookup(holder_id=authz.scoped_name("alice", "h"), groups=ids[:6]), 0).reply
    assert isinstance(alice, m.LookupReply) and alice.hit_chunks == 6  # her own share, whole
    core.check_invariants()
    with pytest.raises(Busy):  # pins: 5 groups > 4
        core.handle(m.Pin(holder_id=bob, groups=ids[:5], ttl_ms=60_000), 0)
    core.handle(m.LeaseRelease(holder_id=bob, lease_id=first.lease_id), 0)
    again = core.handle(m.Lookup(holder_id=bob, groups=ids[:5]), 0).reply
    assert isinstance(again, m.LookupReply) and again.hit_chunks == 5
    core.check_invariants()


def test_evict_tails_of_the_wrong_shape_are_refused_before_they_are_walked() -> None:
    """One granted group with a million tail indexes (1 MB on the wire): refused from the
    lists' lengths, before the renumbering walks every index (~36 ms of the directory's loop for
    one id of fair budget; review, 2026-12-05); a list per group is required too."""
    own = GROUPS[0][:1]
    with pytest.raises(BadRequest, match="evict tails"):
        authorize(m.Evict(groups=own, tails=[[0] * 1_000_000]), "evict", ALICE)
    with pytest.raises(BadRequest, match="evict tails"):
        authorize(m.Evict(groups=own * 2, tails=[[]]), "evict", ALICE)


def test_an_evict_naming_a_group_twice_gets_each_of_the_cores_results() -> None:
    """Merged by group id, the core's last result for a group named twice stood for both: the
    group it evicted read `not_published` (review, stop 68)."""
    mine, theirs = GROUPS[0][0], GROUPS[1][0]
    assert ALICE.owns(mine) and not ALICE.owns(theirs)
    core_reply = m.EvictReply(
        epoch=3,
        results=[
            m.EvictResult(group=mine, status="evicting"),
            m.EvictResult(group=mine, status="not_published"),
        ],
    )
    merged = merge_evict_results([mine, theirs, mine], core_reply, ALICE)
    assert [r.status for r in merged.results] == ["evicting", "not_found", "not_published"]

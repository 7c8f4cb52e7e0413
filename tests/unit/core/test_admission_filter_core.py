"""Live admission (issue 25 item 4; `kvfabric.core.eviction_admission`): the gate a directory
shard applies at put_begin, the filter the density policy builds, and put_begin's `not_admitted`."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfabric.core.eviction import EvictionConfig, EvictionCore, Refused, TenantQuota
from kvfabric.core.eviction_admission import (
    ADMISSION_BLOOM_HASHES,
    AdmissionGate,
    AdmissionView,
    bloom_has,
    bloom_of,
    build_filter,
    length_class,
)
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import DomainDigest, GroupKey, domain_in_group_key
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.eviction import (
    ADMISSION_FILTER_DOMAINS_MAX,
    ADMISSION_FILTER_POOLS_MAX,
    ADMISSION_LENGTH_CLASSES,
    ADMISSION_UNLIMITED,
    AdmissionFilter,
    PoolAdmission,
)

from .dirkit import DOMAIN, groups, key, new_core, register, spec
from .test_directory_quotas import B as OTHER_DOMAIN
from .test_directory_quotas import groups_b

U = ADMISSION_UNLIMITED
A = bytes(DOMAIN.digest()) + b"c" * 32  # a group key of DOMAIN (domain digest, chain hash)
OTHER = bytes(48)  # a group key of another domain


def view(
    pools: dict[str, list[int]],
    *,
    at: int = 0,
    protected: tuple[bytes, ...] = (),
    seen: tuple[bytes, ...] = (),
) -> AdmissionView:
    message = AdmissionFilter(
        generated_ms=at,
        events_seq=0,
        policy="density",
        pools=[PoolAdmission(segment_id=s, group_bytes_max=v) for s, v in pools.items()],
        protected_domains=[domain_in_group_key(GroupKey(p)) for p in protected],
        seen_bloom=bloom_of(seen) if seen else b"",
        seen_bloom_hashes=ADMISSION_BLOOM_HASHES if seen else 0,
    )
    return AdmissionView.of(message, len(encode(message)))


def limits(**by_class: int) -> list[int]:
    out = [U] * ADMISSION_LENGTH_CLASSES
    for name, value in by_class.items():
        out[int(name[1:])] = value
    return out


# ---- the gate ------------------------------------------------------------------------------------


def test_no_filter_admits_and_a_fresh_one_refuses_what_it_lists() -> None:
    counts: dict[str, int] = {}
    gate = AdmissionGate(1_000, lambda n: counts.__setitem__(n, counts.get(n, 0) + 1))
    assert gate.decide(["s1"], A, 3, 100, 0) == (True, "no_filter")
    gate.install(view({"s1": limits(c2=50)}), 10)
    # chunk 3 -> 4 chunks -> bit length 3; chunk 1 -> 2 chunks -> class 2
    assert length_class(1) == 2 and length_class(3) == 3
    assert gate.decide(["s1"], A, 1, 100, 20) == (False, "below_frontier")
    assert gate.decide(["s1"], A, 1, 50, 20) == (True, "filter")  # at the limit: admitted
    assert gate.decide(["s1"], A, 3, 10**9, 20) == (True, "filter")  # class 3 unlimited
    assert gate.decide(["s2"], A, 1, 100, 20) == (True, "filter")  # s2 not listed: room
    assert gate.decide(["s2", "s1"], A, 1, 100, 20) == (False, "below_frontier")  # any replica's pool
    assert counts["admission_refused_below_frontier_total"] == 2
    assert counts["admission_admitted_no_filter_total"] == 1


def test_a_stale_filter_admits_and_a_new_one_applies_again() -> None:
    gate = AdmissionGate(1_000)
    gate.install(view({"s1": limits(c1=0)}), 0)
    assert gate.decide(["s1"], A, 0, 1, 1_000) == (False, "below_frontier")  # age = bound: fresh
    assert gate.decide(["s1"], A, 0, 1, 1_001) == (True, "stale")
    assert gate.age_ms(1_001) == 1_001
    gate.install(view({"s1": limits(c1=0)}, at=5), 2_000)
    assert gate.decide(["s1"], A, 0, 1, 2_500) == (False, "below_frontier")


def test_admission_off_and_protected_domains_always_admit() -> None:
    off = AdmissionGate(0)
    off.install(view({"s1": limits(c1=0)}), 0)
    assert off.decide(["s1"], A, 0, 1, 0) == (True, "off")
    gate = AdmissionGate(1_000)
    gate.install(view({"s1": limits(c1=0)}, protected=(A,)), 0)
    assert gate.decide(["s1"], A, 0, 1, 0) == (True, "guaranteed")
    assert gate.decide(["s1"], OTHER, 0, 1, 0) == (False, "below_frontier")


def test_a_group_the_policy_named_before_passes_the_bloom() -> None:
    gate = AdmissionGate(1_000)
    gate.install(view({"s1": limits(c1=0)}, seen=(OTHER,)), 0)
    assert gate.decide(["s1"], OTHER, 0, 1, 0) == (True, "seen_before")
    assert gate.decide(["s1"], A, 0, 1, 0) == (False, "below_frontier")


@given(st.lists(st.binary(min_size=1, max_size=48), min_size=1, max_size=200))
def test_the_bloom_never_forgets_a_key_put_in(keys: list[bytes]) -> None:
    bloom = bloom_of(keys, nbytes=256)
    assert all(bloom_has(bloom, ADMISSION_BLOOM_HASHES, k) for k in keys)
    assert not bloom_has(b"", ADMISSION_BLOOM_HASHES, keys[0])


def test_an_older_filter_does_not_replace_a_fresh_newer_one() -> None:
    gate = AdmissionGate(1_000)
    assert gate.install(view({"s1": limits(c1=0)}, at=100), 0)
    assert not gate.install(view({}, at=50), 10)
    assert gate.decide(["s1"], A, 0, 1, 20) == (False, "below_frontier")
    assert gate.install(view({}, at=50), 2_000)  # the held one is stale: any filter replaces it


def test_a_filter_over_its_bounds_is_refused_before_it_is_held() -> None:
    with pytest.raises(BadRequest):
        view({f"s{i}": limits() for i in range(ADMISSION_FILTER_POOLS_MAX + 1)})
    with pytest.raises(BadRequest):
        view({"s1": [U] * (ADMISSION_LENGTH_CLASSES + 1)})
    with pytest.raises(BadRequest):
        view({"s1": limits(c1=-2)})
    with pytest.raises(BadRequest):
        AdmissionView.of(
            AdmissionFilter(
                generated_ms=0, events_seq=0, policy="d", pools=[], protected_domains=[DomainDigest(b"x")]
            ),
            0,
        )
    with pytest.raises(BadRequest):
        AdmissionView.of(
            AdmissionFilter(
                generated_ms=0,
                events_seq=0,
                policy="d",
                pools=[],
                seen_bloom=bytes(65_537),
                seen_bloom_hashes=4,
            ),
            0,
        )


class GateMachine(RuleBasedStateMachine):
    """Filters arrive at any time (some out of order), time moves on, keys are judged: the gate
    refuses exactly what the freshest filter it holds refuses, admits everything once it is stale,
    and holds one bounded filter."""

    STALE_MS = 500

    def __init__(self) -> None:
        super().__init__()
        self.gate = AdmissionGate(self.STALE_MS)
        self.now = 0
        self.model: tuple[AdmissionView, int] | None = None  # (view, received)

    @rule(
        pools=st.dictionaries(
            st.sampled_from(["s1", "s2", "s3"]),
            st.lists(
                st.integers(U, 300), min_size=ADMISSION_LENGTH_CLASSES, max_size=ADMISSION_LENGTH_CLASSES
            ),
            max_size=3,
        ),
        generated=st.integers(0, 10_000),
        protected=st.booleans(),
        seen=st.booleans(),
    )
    def arrive(self, pools: dict[str, list[int]], generated: int, protected: bool, seen: bool) -> None:
        v = view(pools, at=generated, protected=(A,) if protected else (), seen=(OTHER,) if seen else ())
        held_fresh = self.model is not None and self.now - self.model[1] <= self.STALE_MS
        installed = self.gate.install(v, self.now)
        expected = not (held_fresh and self.model is not None and generated < self.model[0].generated_ms)
        assert installed == expected
        if installed:
            self.model = (v, self.now)

    @rule(ms=st.integers(0, 400))
    def advance(self, ms: int) -> None:
        self.now += ms

    @rule(
        segments=st.lists(st.sampled_from(["s1", "s2", "s3", "s4"]), min_size=1, max_size=3, unique=True),
        chunk=st.integers(0, 200),
        nbytes=st.integers(1, 400),
        domain=st.sampled_from([A, OTHER]),
    )
    def judge(self, segments: list[str], chunk: int, nbytes: int, domain: bytes) -> None:
        admitted, reason = self.gate.decide(segments, domain, chunk, nbytes, self.now)
        if self.model is None or self.now - self.model[1] > self.STALE_MS:
            assert admitted, "no filter or a stale one must admit"
            return
        v = self.model[0]
        cls = length_class(chunk)
        seen = bloom_has(v.seen_bloom, v.seen_hashes, domain)
        refuses = (
            domain[:16] not in v.protected
            and not seen
            and any(s in v.limits and v.limits[s][cls] != U and nbytes > v.limits[s][cls] for s in segments)
        )
        assert admitted == (not refuses), reason  # never refuses what the filter admits

    @invariant()
    def bounded(self) -> None:
        self.gate.check()


TestGateMachine = GateMachine.TestCase
TestGateMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# ---- the directory: put_begin answers not_admitted -----------------------------------------------


def test_put_begin_answers_not_admitted_and_reserves_nothing() -> None:
    core = new_core(admission_stale_ms=1_000)
    register(core, "s1", capacity=100_000)
    gs = groups(3, seed=7)
    core.set_admission_filter(view({"s1": limits(c2=50)}), 0)  # chunks 1 and 2: class 2
    reply = core.handle(
        m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(g), 100) for g in gs]), 10
    ).reply
    assert isinstance(reply, m.PutBeginReply)
    assert [r.status for r in reply.results] == ["placed", "not_admitted", "not_admitted"]
    assert reply.results[1].tickets == []
    assert core.segments["s1"].reserved_bytes == 100  # only chunk 0's
    assert core.pending_objects == 1
    assert core.counters["admission_refused_below_frontier_total"] == 2
    core.check_invariants()
    # Stale (no newer filter within the bound): admitted.
    again = core.handle(
        m.PutBegin(writer_id="w", request_id="r2", objects=[spec(key(g), 100) for g in gs[1:]]), 1_011
    ).reply
    assert isinstance(again, m.PutBeginReply)
    assert [r.status for r in again.results] == ["placed", "placed"]
    assert core.counters["admission_admitted_stale_total"] == 2
    core.check_invariants()


def test_a_put_the_filter_refuses_on_one_segment_is_placed_on_another_that_admits_it() -> None:
    """Placement picks the segment with the most free bytes; the filter refuses there (past its
    low watermark) while a smaller segment has room (unlisted: it admits): the put goes there,
    not `not_admitted`. Refused on every segment: `not_admitted`, nothing reserved anywhere."""
    core = new_core(admission_stale_ms=1_000)
    register(core, "big", capacity=1_000_000)
    register(core, "small", capacity=10_000)
    gs = groups(3, seed=9)
    core.set_admission_filter(view({"big": limits(c2=50)}), 0)
    reply = core.handle(
        m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(g), 100) for g in gs]), 10
    ).reply
    assert isinstance(reply, m.PutBeginReply)
    assert [r.status for r in reply.results] == ["placed"] * 3
    assert [[t.segment_id for t in r.tickets] for r in reply.results] == [["big"], ["small"], ["small"]]
    assert core.segments["small"].reserved_bytes == 200 and core.segments["big"].reserved_bytes == 100
    assert core.counters["admission_replaced_total"] == 2
    assert core.counters.get("admission_refused_below_frontier_total", 0) == 0
    core.check_invariants()
    # both refuse: not admitted, nothing reserved, counted once per object
    core.set_admission_filter(view({"big": limits(c2=50), "small": limits(c2=50)}, at=20), 20)
    more = groups(3, seed=10)
    again = core.handle(
        m.PutBegin(writer_id="w", request_id="r2", objects=[spec(key(g), 100) for g in more]), 21
    ).reply
    assert isinstance(again, m.PutBeginReply)
    assert [r.status for r in again.results] == ["placed", "not_admitted", "not_admitted"]
    assert core.segments["small"].reserved_bytes == 200 and core.segments["big"].reserved_bytes == 200
    assert core.counters["admission_refused_below_frontier_total"] == 2
    core.check_invariants()


def test_a_refused_put_is_not_passed_by_placing_fewer_replicas() -> None:
    """Two replicas refused (200 bytes over the limit of 150) on the two largest segments, and
    only the small one admits: not re-placed as one replica there (fewer copies than asked for
    to get past the filter), nor as one replica under the limit: `not_admitted`, nothing
    reserved."""
    core = new_core(admission_stale_ms=1_000)
    for n, (zone, capacity) in enumerate((("z1", 10_000), ("z2", 100_000), ("z3", 100_000))):
        register(core, f"s{n}", capacity=capacity, zone=zone)
    (g,) = groups(1, seed=13)
    core.set_admission_filter(view({"s1": limits(c1=150), "s2": limits(c1=150)}), 0)
    reply = core.handle(
        m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(g), 100)], replicas=2), 10
    ).reply
    assert isinstance(reply, m.PutBeginReply)
    assert [r.status for r in reply.results] == ["not_admitted"]
    assert all(core.segments[f"s{n}"].reserved_bytes == 0 for n in range(3))
    assert core.counters.get("admission_replaced_total", 0) == 0
    core.check_invariants()


def test_a_groups_later_ranks_avoid_the_segments_its_first_was_refused_on() -> None:
    """Admission is decided by a group's first member; its later members (other TP ranks) are
    placed without the segments the filter refused it on, not back on the largest one."""
    core = new_core(admission_stale_ms=1_000)
    register(core, "big", capacity=1_000_000)
    register(core, "small", capacity=100_000)
    (g,) = groups(1, seed=14, tp_size=4)
    core.set_admission_filter(view({"big": limits(c1=50)}), 0)
    where = []
    for rank in range(4):
        reply = core.handle(
            m.PutBegin(writer_id="w", request_id=f"r{rank}", objects=[spec(key(g, rank=rank), 100)]), 10
        ).reply
        assert isinstance(reply, m.PutBeginReply) and reply.results[0].status == "placed"
        where += [t.segment_id for t in reply.results[0].tickets]
    assert where == ["small"] * 4
    assert core.counters["admission_replaced_total"] == 1  # judged once, by rank 0
    core.check_invariants()
    # a later rank with no room but where its group was refused still goes there: a placed
    # rank is never stranded by its group's filter
    (h,) = groups(1, seed=15, tp_size=2)
    first = core.handle(
        m.PutBegin(writer_id="w", request_id="h0", objects=[spec(key(h, rank=0), 100)]), 11
    ).reply
    assert isinstance(first, m.PutBeginReply) and first.results[0].tickets[0].segment_id == "small"
    core.segments["small"].reserved_bytes = core.segments["small"].capacity_bytes  # full now
    second = core.handle(
        m.PutBegin(writer_id="w", request_id="h1", objects=[spec(key(h, rank=1), 100)]), 12
    ).reply
    assert isinstance(second, m.PutBeginReply) and second.results[0].status == "placed"
    assert second.results[0].tickets[0].segment_id == "big"


def test_a_later_rank_is_not_placed_with_fewer_replicas_than_there_is_room_for() -> None:
    """Rank 0 of a two-replica group, refused on `big`, goes to sa and sb; sb fills. Rank 1
    placed without `big` would get one replica (sa): it gets two, `big` included, as the
    group's placement without a filter would."""
    core = new_core(admission_stale_ms=1_000)
    register(core, "big", capacity=1_000_000, zone="z1")
    register(core, "sa", capacity=100_000, zone="z2")
    register(core, "sb", capacity=100_000, zone="z3")
    (g,) = groups(1, seed=16, tp_size=2)
    core.set_admission_filter(view({"big": limits(c1=150)}), 0)
    first = core.handle(
        m.PutBegin(writer_id="w", request_id="g0", objects=[spec(key(g, rank=0), 100)], replicas=2), 10
    ).reply
    assert isinstance(first, m.PutBeginReply) and first.results[0].status == "placed"
    assert sorted(t.segment_id for t in first.results[0].tickets) == ["sa", "sb"]
    held = core.segments["sb"].reserved_bytes
    core.segments["sb"].reserved_bytes = core.segments["sb"].capacity_bytes  # full now
    second = core.handle(
        m.PutBegin(writer_id="w", request_id="g1", objects=[spec(key(g, rank=1), 100)], replicas=2), 11
    ).reply
    assert isinstance(second, m.PutBeginReply) and second.results[0].status == "placed"
    assert sorted(t.segment_id for t in second.results[0].tickets) == ["big", "sa"]
    core.segments["sb"].reserved_bytes = held
    core.check_invariants()


def test_a_one_member_group_placed_again_keeps_no_refused_segments() -> None:
    """Only a group's later members read the segments it was refused on: a group of one member
    (TP 1) does not hold that set while it builds (up to every segment's id, per group)."""
    core = new_core(admission_stale_ms=1_000)
    register(core, "big", capacity=1_000_000)
    register(core, "small", capacity=100_000)
    (g,) = groups(1, seed=17)
    (h,) = groups(1, seed=18, tp_size=2)
    core.set_admission_filter(view({"big": limits(c1=50)}), 0)
    reply = core.handle(
        m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(g), 100), spec(key(h), 100)]), 10
    ).reply
    assert isinstance(reply, m.PutBeginReply)
    assert [[t.segment_id for t in r.tickets] for r in reply.results] == [["small"], ["small"]]
    refused_on = {
        member.key: group.refused_on for group in core.building.values() for member in group.members.values()
    }
    assert refused_on == {key(g): frozenset(), key(h): frozenset({"big"})}
    core.check_invariants()


# ---- the policy: the filter mirrors the density core's own admission ---------------------------


def trained_core(seed: int, capacity: int) -> tuple[EvictionCore, int]:
    """A density core (predicted admission) fed a random history with reuses, densities
    computed, its pool `seg` at or past its low watermark; returns it and the time now."""
    rng = random.Random(seed)
    core = EvictionCore(
        EvictionConfig(policy="density", admission="predicted", density_recompute_every=10**9),
        {b"p" * 16: TenantQuota(guaranteed_bytes=10**9)},
    )
    core.set_capacity("seg", capacity)
    now = 0
    ids: list[int] = []
    for i in range(300):
        now += rng.randint(1, 3_000)
        if ids and rng.random() < 0.4:
            core.access(rng.choice(ids), now)
        else:
            effects = core.insert(
                i,
                tenant=b"t" * 16,
                pool="seg",
                size=rng.randint(1, 20),
                parent=None,
                chunk_index=rng.randint(0, 100),
                now_ms=now,
            )
            if not any(isinstance(e, Refused) for e in effects):
                ids.append(i)
    assert core._density is not None
    core._density.recompute()
    return core, now


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), chunk=st.integers(0, 200), size=st.integers(1, 40))
def test_the_filter_refuses_a_first_named_chunk_exactly_when_the_core_would(
    seed: int, chunk: int, size: int
) -> None:
    core, now = trained_core(seed, capacity=200)
    assert core.used_bytes("seg") >= 0.8 * 200  # pressed: the pool is listed when limits bite
    message = build_filter(core, {"seg": 200}, now, events_seq=0)
    gate = AdmissionGate(1_000)
    gate.install(AdmissionView.of(message, len(encode(message))), now)
    filter_admits, reason = gate.decide(["seg"], repr(10_000).encode(), chunk, size, now)
    (effect,) = core.insert(
        10_000, tenant=b"t" * 16, pool="seg", size=size, parent=None, chunk_index=chunk, now_ms=now
    )
    core_admits = not isinstance(effect, Refused)
    assert filter_admits or not core_admits  # the filter never refuses what the core admits
    if reason != "seen_before":  # a bloom false positive admits a first-named chunk
        assert filter_admits == core_admits


def test_the_filters_bloom_holds_the_groups_the_policy_named(monkeypatch: pytest.MonkeyPatch) -> None:
    core, now = trained_core(5, capacity=200)
    # A frontier that bites (trained cores keep a leaf of density 0, so their limits never do).
    monkeypatch.setattr(core, "_density_frontier", lambda _now_ms: 1e9)
    message = build_filter(core, {"seg": 200}, now, events_seq=0)
    assert message.pools  # the bloom is built only while a pool is listed
    assert all(bloom_has(message.seen_bloom, message.seen_bloom_hashes, repr(i).encode()) for i in (0, 1))
    assert message.protected_domains == [b"p" * 16]  # below its guaranteed share: always admitted


def test_a_pool_with_room_is_not_listed() -> None:
    core, now = trained_core(3, capacity=10**9)
    assert build_filter(core, {"seg": 10**9}, now, events_seq=5).pools == []


def test_a_tenant_below_its_guaranteed_share_is_admitted_while_a_scanner_is_refused() -> None:
    """Issue 25 item 5 with admission: the filter lists the protected domain (built from the
    policy's guarantees), so put_begin admits its chunks where another tenant's are refused."""
    core = new_core(admission_stale_ms=1_000)
    register(core, "s1", capacity=100_000)
    core.set_admission_filter(view({"s1": limits(c2=0)}, protected=(A,)), 0)  # A: DOMAIN's group key
    mine, scan = groups(2, seed=3), groups_b(2, seed=4)
    reply = core.handle(
        m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(g), 100) for g in (*mine, *scan)]), 5
    ).reply
    assert isinstance(reply, m.PutBeginReply)
    assert [r.status for r in reply.results] == ["placed", "placed", "placed", "not_admitted"]
    assert A[:16] != OTHER_DOMAIN
    assert core.counters["admission_admitted_guaranteed_total"] == 2
    core.check_invariants()


def test_a_later_rank_of_a_building_group_is_admitted_by_a_newer_filter() -> None:
    """Admission is decided per chunk group, by its first member: rank 0 placed before a filter
    arrived, rank 1 after it (the filter refuses every class) is placed too, so the group can
    publish instead of holding rank 0's reservation until its write deadline."""
    core = new_core(admission_stale_ms=1_000)
    register(core, "s1", capacity=100_000)
    (g,) = groups(1, seed=11, tp_size=2)
    first = core.handle(
        m.PutBegin(writer_id="w", request_id="r0", objects=[spec(key(g, rank=0), 100)]), 5
    ).reply
    assert isinstance(first, m.PutBeginReply) and first.results[0].status == "placed"
    core.set_admission_filter(view({"s1": [0] * ADMISSION_LENGTH_CLASSES}, at=6), 6)
    second = core.handle(
        m.PutBegin(writer_id="w", request_id="r1", objects=[spec(key(g, rank=1), 100)]), 7
    ).reply
    assert isinstance(second, m.PutBeginReply)
    assert second.results[0].status == "placed"
    (other,) = groups(1, seed=12, tp_size=2)  # a new group is still judged by the filter
    third = core.handle(
        m.PutBegin(writer_id="w", request_id="r2", objects=[spec(key(other, rank=0), 100)]), 8
    ).reply
    assert isinstance(third, m.PutBeginReply) and third.results[0].status == "not_admitted"
    core.check_invariants()


def test_more_protected_domains_than_a_filter_names_lists_no_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A domain left out of the filter would lose its guarantee: past the bound the filter lists
    no pool (everything admitted) and no domain."""
    core, now = trained_core(1, capacity=200)
    # A frontier that bites (trained cores keep a leaf of density 0, so their limits never do).
    monkeypatch.setattr(core, "_density_frontier", lambda _now_ms: 1e9)
    assert build_filter(core, {"seg": 200}, now, events_seq=0).pools  # listed within the bound
    for i in range(ADMISSION_FILTER_DOMAINS_MAX):  # with b"p" * 16: one over the bound
        core.quotas[i.to_bytes(16, "big")] = TenantQuota(guaranteed_bytes=10**9)
    message = build_filter(core, {"seg": 200}, now, events_seq=0)
    assert message.pools == [] and message.protected_domains == []
    del core.quotas[(0).to_bytes(16, "big")]  # back at the bound: pools and every domain listed
    message = build_filter(core, {"seg": 200}, now, events_seq=0)
    assert message.pools and len(message.protected_domains) == ADMISSION_FILTER_DOMAINS_MAX

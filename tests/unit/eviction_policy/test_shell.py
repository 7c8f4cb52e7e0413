"""The eviction-policy shell's bookkeeping (no NATS): directory events into the core, quotas
from the environment, and status."""

from __future__ import annotations

import msgspec
import pytest

from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore, TenantQuota
from kvfabric.eviction_policy.group_records import LOST_LINKS_EXPIRED_PER_EVENT, LOST_LINKS_KEEP_MS
from kvfabric.eviction_policy.settings import load_eviction_settings, parse_quotas
from kvfabric.eviction_policy.shell import EvictionShell, group_id_of
from kvfabric.format.ids import ChainHash, DomainDigest, Namespace
from kvfabric.proto import directory as m
from kvfabric.runtime.config import SettingsError

NAMESPACE_A = Namespace(bytes(4) + b"A" * 16 + bytes(34))
NAMESPACE_B = Namespace(bytes(4) + b"B" * 16 + bytes(34))


def shell(**quotas: TenantQuota) -> EvictionShell:
    core = EvictionCore(
        EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.25),
        {k.encode() * 16: q for k, q in quotas.items()},
    )
    return EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)


A = DomainDigest(b"A" * 16)  # NAMESPACE_A's share domain digest


def chain(i: int) -> ChainHash:
    return ChainHash(i.to_bytes(32, "little"))


def published(
    i: int, namespace: Namespace = NAMESPACE_A, parent: int | None = None, **held: int
) -> m.GroupPublished:
    return m.GroupPublished(
        group=chain(i),
        chunk_index=0 if parent is None else parent + 1,  # after its parent in a prefix
        members=1,
        namespace=namespace,
        parent=ChainHash(b"") if parent is None else chain(parent),
        placements=[m.SegmentBytes(s, b) for s, b in held.items()],
    )


def test_events_drive_the_core_and_victims_map_back_to_group_ids() -> None:
    sh = shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    sh.apply(m.SegmentUp(segment_id="s2", incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, s1=30, s2=30), 1)
    sh.apply(published(2, parent=1, s1=30), 2)
    sh.apply(m.GroupsAccessed(groups=[m.GroupHits(chain(1), 2, A)]), 3)
    assert sh.core.used_bytes("s1") == 60 and sh.core.tenant_bytes(A) == 90
    (batch,) = sh.core.tick(4)  # s1 at 60 % > 50 %: the tail (2) before its head (1)
    assert isinstance(batch, EvictBatch) and batch.victims == (A + chain(2), A + chain(1))
    assert sh._group_ids[A + chain(2)] == group_id_of(NAMESPACE_A, 2, chain(2))
    assert len(sh._group_ids[A + chain(2)]) == 90
    sh.apply(m.GroupEvicted(group=chain(2), reason="policy", domain=A), 5)  # may overtake the reply
    assert A + chain(2) not in sh.core and A + chain(2) not in sh._group_ids
    sh.apply(m.SegmentDown(segment_id="s2", incarnation=1, reason="heartbeat_timeout"), 6)
    assert sh.core.used_bytes("s2") == 0 and sh.core.tenant_bytes(b"A" * 16) == 30  # 1 lives on in s1
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), 7)
    assert len(sh.core) == 0 and not sh._group_ids
    assert sh.events_applied == 8
    sh.core.check_invariants()


def test_a_head_lost_with_its_segment_and_adopted_again_still_takes_its_disk_tail_with_it() -> None:
    """Head P on s1's disk, its disk-only tail C on s2's. s1 is lost, comes back with its disk
    tier and the directory adopts P and publishes it again, with no parent or children in the
    event: the links kept from before the loss still make C go before P (a review found that
    forgetting them at the loss, to save one entry per lost group, broke this)."""
    sh = shell()
    for segment in ("s1", "s2"):
        sh.apply(m.SegmentUp(segment_id=segment, incarnation=1, capacity_bytes=1_000), 0)
    head, tail = A + chain(1), A + chain(2)
    sh.apply(msgspec.structs.replace(published(1, s1=10), disk_placements=[m.SegmentBytes("s1", 10)]), 1)
    sh.apply(
        msgspec.structs.replace(published(2, parent=1, s2=10), disk_placements=[m.SegmentBytes("s2", 10)]), 2
    )
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), 3)
    sh.apply(invalidated(1), 3)  # the directory's in the same tick: no replica left
    assert head not in sh.core and head not in sh._group_ids
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=2, capacity_bytes=1_000), 4)
    sh.apply(msgspec.structs.replace(published(1, s1=10), disk_placements=[m.SegmentBytes("s1", 10)]), 5)
    assert head in sh.core and tail in sh.core
    assert sh._with_disk_tails([head]) == [tail, head]
    sh.core.check_invariants()


def invalidated(i: int) -> m.GroupInvalidated:
    """What the directory emits right after a `segment_down` for a group left with no replica."""
    return m.GroupInvalidated(group=chain(i), reason="replica_lost", domain=A)


def lost_and_adopted_setup() -> EvictionShell:
    sh = shell()
    for segment in ("s1", "s2", "s3"):
        sh.apply(m.SegmentUp(segment_id=segment, incarnation=1, capacity_bytes=1_000), 0)
    return sh


def on_disk(event: m.GroupPublished, segment: str) -> m.GroupPublished:
    return msgspec.structs.replace(event, disk_placements=[m.SegmentBytes(segment, 10)])


def test_links_of_lost_groups_go_after_the_keep_time_unless_they_are_back() -> None:
    """A lost group may be adopted again from a disk tier, published with no parent: its links
    stay `LOST_LINKS_KEEP_MS` after the loss, then go unless it is back. So lost groups leave
    nothing behind, however many segments are lost over time."""
    sh = lost_and_adopted_setup()
    sh.apply(published(1, s3=10), 1)  # the shared head, on s3 (lives on)
    sh.apply(published(2, parent=1, s1=10), 1)  # s1's arena only
    sh.apply(published(3, parent=2, s1=10), 1)
    sh.apply(on_disk(published(4, parent=1, s2=10), "s2"), 1)
    sh.apply(on_disk(published(5, parent=1, s2=10), "s2"), 1)
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), 10)
    sh.apply(invalidated(2), 10)
    sh.apply(invalidated(3), 10)
    sh.apply(m.SegmentDown(segment_id="s2", incarnation=1, reason="heartbeat_timeout"), 20)
    sh.apply(invalidated(4), 20)
    sh.apply(invalidated(5), 20)
    assert A + chain(4) not in sh.core and set(sh._parent) == {A + chain(k) for k in (2, 3, 4, 5)}
    sh.apply(m.SegmentUp(segment_id="s2", incarnation=2, capacity_bytes=1_000), 30)
    sh.apply(on_disk(published(4, s2=10), "s2"), 31)  # adopted: no parent in the event
    assert sh._with_disk_tails([A + chain(1)]) == [A + chain(4), A + chain(1)]
    sh.apply(m.GroupsAccessed(groups=[]), 10 + LOST_LINKS_KEEP_MS - 1)
    assert set(sh._parent) == {A + chain(k) for k in (2, 3, 4, 5)}
    sh.apply(m.GroupsAccessed(groups=[]), 10 + LOST_LINKS_KEEP_MS)  # s1's hour is over
    assert set(sh._parent) == {A + chain(4), A + chain(5)}
    sh.apply(m.GroupsAccessed(groups=[]), 20 + LOST_LINKS_KEEP_MS)  # s2's: 5 never came back
    assert sh._parent == {A + chain(4): A + chain(1)}
    assert sh._children == {A + chain(1): {A + chain(4)}} and not sh._lost_links and not sh._lost_until
    sh.apply(m.GroupEvicted(group=chain(4), reason="policy", domain=A), 40 + LOST_LINKS_KEEP_MS)
    sh.apply(m.GroupEvicted(group=chain(1), reason="policy", domain=A), 41 + LOST_LINKS_KEEP_MS)
    assert not sh._parent and not sh._children and len(sh.core) == 0
    sh.core.check_invariants()


def test_a_tail_last_seen_in_an_arena_keeps_its_links_for_its_disk_replica_elsewhere() -> None:
    """Tail in s1's arena and on s2's disk; s2 is lost first (the records drop its disk pool),
    then s1: the tail leaves the core from an arena, but s2 comes back with its disk tier and
    the directory adopts the tail again, with no parent: it must still go before its head (a
    review's repro: unlinked at once, the head went first)."""
    sh = lost_and_adopted_setup()
    head, tail = A + chain(1), A + chain(2)
    sh.apply(published(1, s3=10), 1)
    sh.apply(on_disk(published(2, parent=1, s1=10, s2=10), "s2"), 2)
    sh.apply(m.SegmentDown(segment_id="s2", incarnation=1, reason="heartbeat_timeout"), 3)
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), 4)
    sh.apply(invalidated(2), 4)
    sh.apply(m.SegmentUp(segment_id="s2", incarnation=2, capacity_bytes=1_000), 5)
    sh.apply(on_disk(published(2, s2=10), "s2"), 6)
    assert sh._with_disk_tails([head]) == [tail, head]


def test_a_group_lost_twice_keeps_its_links_for_its_second_loss_too() -> None:
    """Lost, adopted again, lost again within the hour: the first loss's hour ending does not
    unlink it (a review's repro), the second's does, if it is not back by then."""
    sh = lost_and_adopted_setup()
    head, tail = A + chain(1), A + chain(2)
    adopted = on_disk(published(2, s1=10), "s1")
    sh.apply(published(1, s2=10), 1)
    sh.apply(on_disk(published(2, parent=1, s1=10), "s1"), 2)
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), 10)
    sh.apply(invalidated(2), 10)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=2, capacity_bytes=1_000), 20)
    sh.apply(adopted, 21)
    sh.apply(
        m.SegmentDown(segment_id="s1", incarnation=2, reason="heartbeat_timeout"), 10 + LOST_LINKS_KEEP_MS - 5
    )
    sh.apply(invalidated(2), 10 + LOST_LINKS_KEEP_MS - 4)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=3, capacity_bytes=1_000), 10 + LOST_LINKS_KEEP_MS + 1)
    sh.apply(adopted, 10 + LOST_LINKS_KEEP_MS + 2)
    assert sh._with_disk_tails([head]) == [tail, head]
    sh.apply(
        m.SegmentDown(segment_id="s1", incarnation=3, reason="heartbeat_timeout"), 10 + LOST_LINKS_KEEP_MS + 3
    )
    sh.apply(m.GroupsAccessed(groups=[]), 10 + 3 * LOST_LINKS_KEEP_MS)
    assert not sh._parent and not sh._lost_until and not sh._lost_links


def test_lost_links_expire_a_bounded_number_per_event() -> None:
    """A big segment's hour ending unlinks `LOST_LINKS_EXPIRED_PER_EVENT` groups per event,
    not all of them in one (no stall of the policy's loop)."""
    sh = lost_and_adopted_setup()
    n = LOST_LINKS_EXPIRED_PER_EVENT + 10
    sh.apply(published(1, s2=1), 1)
    for i in range(2, n + 2):
        sh.apply(published(i, parent=1, s1=1), 1)
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), 2)
    assert len(sh._parent) == n
    sh.apply(m.GroupsAccessed(groups=[]), 2 + LOST_LINKS_KEEP_MS)
    assert len(sh._parent) == 10 and len(sh._lost_until) == 10
    sh.apply(m.GroupsAccessed(groups=[]), 3 + LOST_LINKS_KEEP_MS)
    assert not sh._parent and not sh._children and not sh._lost_links and not sh._lost_until


def test_an_event_without_placements_is_ignored_not_misfiled() -> None:
    sh = shell()
    sh.apply(m.GroupPublished(group=chain(1), chunk_index=0, members=1), 0)  # an old directory
    assert len(sh.core) == 0


def test_status_reports_pools_tenants_and_quotas() -> None:
    sh = shell(A=TenantQuota(hard_bytes=50, guaranteed_bytes=10))
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1000), 0)
    sh.apply(published(1, s1=40), 1)
    sh.apply(published(2, namespace=NAMESPACE_B, s1=5), 1)
    st = sh.status()
    assert [(p.segment_id, p.capacity_bytes, p.used_bytes) for p in st.pools] == [("s1", 1000, 45)]
    assert [(t.domain_digest[:1], t.used_bytes, t.hard_bytes, t.guaranteed_bytes) for t in st.tenants] == [
        (b"A", 40, 50, 10),
        (b"B", 5, 0, 0),
    ]
    assert st.objects == 2 and st.counters["inserts_total"] == 2


def test_quotas_parse_strictly() -> None:
    digest = "ab" * 16
    assert parse_quotas(f'{{"{digest}": {{"hard_bytes": 100, "guaranteed_bytes": 10}}}}') == {
        bytes.fromhex(digest): TenantQuota(hard_bytes=100, guaranteed_bytes=10)
    }
    assert parse_quotas("") == {}
    for bad in (
        "[1]",
        "{not json",
        '{"abcd": {"hard_bytes": 1}}',  # not a 16-byte digest
        f'{{"{digest}": {{"hard": 1}}}}',  # unknown field
        f'{{"{digest}": {{"hard_bytes": -1}}}}',
        f'{{"{digest}": {{"hard_bytes": 5, "guaranteed_bytes": 6}}}}',
    ):
        with pytest.raises(SettingsError):
            parse_quotas(bad)


def test_settings_reject_inverted_watermarks_and_unknown_policies() -> None:
    ok = load_eviction_settings(
        {
            "KVF_EVICTION_POLICY": "lru",
            "KVF_EVICTION_HIGH_WATERMARK_PCT": "70",
            "KVF_EVICTION_LOW_WATERMARK_PCT": "60",
        }
    )
    assert ok.core.policy == "lru" and ok.core.high_watermark == 0.7
    with pytest.raises(SettingsError):
        load_eviction_settings(
            {"KVF_EVICTION_HIGH_WATERMARK_PCT": "50", "KVF_EVICTION_LOW_WATERMARK_PCT": "60"}
        )
    with pytest.raises(SettingsError):
        load_eviction_settings({"KVF_EVICTION_POLICY": "fifo"})
    with pytest.raises(SettingsError):  # a full segment is never over 100 %: never pressed
        load_eviction_settings({"KVF_EVICTION_HIGH_WATERMARK_PCT": "100"})
    assert load_eviction_settings({}).core.policy == "density"  # the default (docs/eviction-policy.md)
    assert load_eviction_settings({"KVF_EVICTION_POLICY": "s3fifo"}).core.policy == "s3fifo"
    assert load_eviction_settings({}).core.density_recompute_every == 2048
    tuned = load_eviction_settings({"KVF_EVICTION_DENSITY_RECOMPUTE_EVERY": "64"})
    assert tuned.core.density_recompute_every == 64
    with pytest.raises(SettingsError):
        load_eviction_settings({"KVF_EVICTION_DENSITY_RECOMPUTE_EVERY": "0"})
    # 1,024 victims a tick: 256 (1,280 groups a second) failed saves (docs/eviction-policy.md)
    assert load_eviction_settings({}).core.batch_max == 1024
    assert load_eviction_settings({"KVF_EVICTION_BATCH_MAX": "256"}).core.batch_max == 256
    for bad in ("0", "4097"):  # the protocol's bound on one evict request
        with pytest.raises(SettingsError):
            load_eviction_settings({"KVF_EVICTION_BATCH_MAX": bad})


def test_the_inflow_horizon_is_two_ticks_unless_set_and_zero_turns_it_off() -> None:
    # 8 x 16 MiB saves into a 4 GiB segment lost 46-70 % of their chunks without it
    # (docs/eviction-policy.md, "Writers faster than the ticks")
    assert load_eviction_settings({}).core.inflow_horizon_ms == 400
    assert load_eviction_settings({"KVF_EVICTION_TICK_MS": "50"}).core.inflow_horizon_ms == 100
    assert load_eviction_settings({"KVF_EVICTION_INFLOW_HORIZON_MS": "0"}).core.inflow_horizon_ms == 0
    assert load_eviction_settings({"KVF_EVICTION_INFLOW_HORIZON_MS": "1500"}).core.inflow_horizon_ms == 1500
    for bad in ("-1", "600001", "soon"):
        with pytest.raises(SettingsError):
            load_eviction_settings({"KVF_EVICTION_INFLOW_HORIZON_MS": bad})
    # victims the disk cannot take before a writer fills the arena are dropped (shell._room_until_ms)
    assert load_eviction_settings({}).demote_cut_for_room
    assert not load_eviction_settings({"KVF_EVICTION_DEMOTE_CUT_FOR_ROOM": "0"}).demote_cut_for_room
    with pytest.raises(SettingsError):
        load_eviction_settings({"KVF_EVICTION_DEMOTE_CUT_FOR_ROOM": "2"})


def test_two_domains_with_one_chain_hash_stay_two_groups() -> None:
    """A tenant that forged another domain's chain hash gets its own directory group; the policy
    must keep the two apart (review finding: it conflated them and lost track of the real one)."""
    sh = shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1000), 0)
    sh.apply(published(1, s1=40), 1)
    sh.apply(published(1, namespace=NAMESPACE_B, s1=5), 2)  # B's group, same chain hash
    assert len(sh.core) == 2 and sh.core.tenant_bytes(b"B" * 16) == 5
    sh.apply(m.GroupEvicted(group=chain(1), reason="policy", domain=DomainDigest(b"B" * 16)), 3)
    assert A + chain(1) in sh.core and sh._group_ids[A + chain(1)] == group_id_of(NAMESPACE_A, 0, chain(1))

"""Directory core scenarios: short scripts of events with the expected outcome inline."""

from __future__ import annotations

import pytest

from kvfabric.core.directory import DirectoryCore, EmitEvent, FreeSlots, Outcome
from kvfabric.format.errors import BadRequest, BatchTooLarge, NotFound, StaleGeneration
from kvfabric.format.ids import ChainHash, DomainDigest, GroupId, ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.tickets import ticket_signature_valid

from .dirkit import SECRET, confirm_all, groups, key, lookup, new_core, put, register, spec


def test_nothing_readable_before_publish_then_readable_after() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    begin = core.handle(m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(g))]), 0).reply
    assert isinstance(begin, m.PutBeginReply)
    (res,) = begin.results
    assert res.status == "placed" and len(res.tickets) == 1
    assert ticket_signature_valid(res.tickets[0], SECRET)
    assert lookup(core, [g]).hit_chunks == 0
    confirm_all(core, begin, 0)
    assert lookup(core, [g]).hit_chunks == 0  # confirmed is still not published
    commit = core.handle(m.PutCommit(writer_id="w", request_id="c", keys=[key(g)]), 0).reply
    assert isinstance(commit, m.PutCommitReply)
    assert commit.results[0].status == "published"
    hit = lookup(core, [g])
    assert hit.hit_chunks == 1 and hit.lease_id > 0
    assert hit.objects[0].replicas[0].segment_id == "s1"
    core.check_invariants()


def test_chunk_group_publishes_only_when_every_rank_committed() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1, tp_size=2)
    assert put(core, [key(g, rank=0)], writer="rank0").results[0].status == "waiting_group"
    assert lookup(core, [g]).hit_chunks == 0
    assert put(core, [key(g, rank=1)], writer="rank1", request_id="r2").results[0].status == "published"
    assert lookup(core, [g]).hit_chunks == 1
    core.check_invariants()


def test_fold_stops_at_first_gap() -> None:
    core = new_core()
    register(core, "s1")
    gs = groups(3)
    put(core, [key(gs[0]), key(gs[2])])
    hit = lookup(core, gs)
    assert hit.hit_chunks == 1
    assert [o.chunk_index for o in hit.objects] == [0]


def test_second_writer_gets_in_flight_and_published_key_gets_exists() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    first = core.handle(
        m.PutBegin(writer_id="a", request_id="1", objects=[spec(key(g))], write_ttl_ms=500), 10
    ).reply
    second = core.handle(m.PutBegin(writer_id="b", request_id="1", objects=[spec(key(g))]), 20).reply
    assert isinstance(first, m.PutBeginReply) and isinstance(second, m.PutBeginReply)
    assert second.results[0].status == "in_flight"
    assert second.results[0].deadline_ms == 510
    retried = core.handle(m.PutBegin(writer_id="a", request_id="1", objects=[spec(key(g))]), 30).reply
    assert retried == first  # a retried request id gets the same answer
    confirm_all(core, first, 40)
    core.handle(m.PutCommit(writer_id="a", request_id="2", keys=[key(g)]), 40)
    third = core.handle(m.PutBegin(writer_id="b", request_id="2", objects=[spec(key(g))]), 50).reply
    assert isinstance(third, m.PutBeginReply)
    assert third.results[0].status == "exists"


def test_dead_writer_is_reclaimed_and_late_confirm_is_refused() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    begin = core.handle(
        m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(g))], write_ttl_ms=100), 0
    ).reply
    assert isinstance(begin, m.PutBeginReply)
    assert core.segments["s1"].reserved_bytes == 100
    core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), 150)
    core.tick(150)
    assert core.segments["s1"].reserved_bytes == 0 and core.pending_objects == 0
    t = begin.results[0].tickets[0]
    late = core.handle(
        m.ConfirmReplicas(
            segment_id="s1",
            incarnation=1,
            confirms=[
                m.ReplicaConfirm(
                    ticket_id=t.ticket_id,
                    key=t.key,
                    slot=3,
                    slot_generation=1,
                    size_bytes=100,
                    checksum=t.checksum,
                )
            ],
        ),
        160,
    )
    assert isinstance(late.reply, m.ConfirmReply)
    assert late.reply.results[0].status == "unknown_ticket"
    core.check_invariants()


def test_confirmed_then_expired_slot_is_freed_and_accounted_on_ack() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    begin = core.handle(
        m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(g))], write_ttl_ms=100), 0
    ).reply
    assert isinstance(begin, m.PutBeginReply)
    confirm_all(core, begin, 10)
    core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), 150)
    effects = core.tick(150)
    frees = [e for e in effects if isinstance(e, FreeSlots)]
    assert len(frees) == 1 and frees[0].slots[0].slot == 0
    assert core.segments["s1"].reserved_bytes == 100  # until the segment says it freed it
    core.handle(m.SlotsFreed(segment_id="s1", incarnation=1, freed=[m.FreedSlot(ObjectKey(b""), 0, 1)]), 160)
    assert core.segments["s1"].reserved_bytes == 0
    core.check_invariants()


def test_leased_group_is_not_evicted_until_released() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    put(core, [key(g)])
    hit = lookup(core, [g])
    evict = core.handle(m.Evict(groups=[g.group_id()]), 0).reply
    assert isinstance(evict, m.EvictReply)
    assert evict.results[0].status == "leased"
    core.handle(m.LeaseRelease(holder_id="reader", lease_id=hit.lease_id), 0)
    out = core.handle(m.Evict(groups=[g.group_id()]), 0)
    assert isinstance(out.reply, m.EvictReply)
    assert out.reply.results[0].status == "evicting"
    assert any(isinstance(e, FreeSlots) for e in out.effects)
    assert lookup(core, [g]).hit_chunks == 0
    core.check_invariants()


def test_lease_expiry_makes_group_evictable_but_frees_nothing_by_itself() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    put(core, [key(g)])
    lookup(core, [g], now=0, ttl=100)
    core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), 200)
    effects = core.tick(200)
    assert not any(isinstance(e, FreeSlots) for e in effects)
    assert lookup(core, [g], now=200).hit_chunks == 1


def test_segment_restart_invalidates_its_placements() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    put(core, [key(g)])
    register(core, "s1", now=10, incarnation=2)
    assert lookup(core, [g], now=10).hit_chunks == 0
    core.tick(10)
    assert not core.published
    with pytest.raises(StaleGeneration):
        core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), 20)
    core.check_invariants()


def test_stale_epoch_rejected_and_counted() -> None:
    core = new_core()
    core.epoch = 3
    with pytest.raises(StaleGeneration):
        core.handle(m.Lookup(holder_id="h", groups=[], epoch=2), 0)
    assert core.counters["stale_epoch_rejected_total"] == 1


def test_replicas_spread_over_zones_and_no_capacity_is_clear() -> None:
    core = new_core()
    register(core, "a1", zone="za", rack="r1", capacity=1000)
    register(core, "a2", zone="za", rack="r2", capacity=5000)
    register(core, "b1", zone="zb", rack="r1", capacity=200)
    (g,) = groups(1)
    begin = core.handle(
        m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(g), 150)], replicas=2), 0
    ).reply
    assert isinstance(begin, m.PutBeginReply)
    assert {t.segment_id for t in begin.results[0].tickets} == {"a2", "b1"}
    (g2,) = groups(1, seed=9)
    big = core.handle(m.PutBegin(writer_id="w", request_id="r2", objects=[spec(key(g2), 9000)]), 0).reply
    assert isinstance(big, m.PutBeginReply)
    assert big.results[0].status == "no_capacity"


def test_bad_input_is_typed() -> None:
    core = new_core()
    with pytest.raises(BadRequest):
        core.handle(
            m.PutBegin(
                writer_id="w",
                request_id="r",
                objects=[m.ObjectSpec(key=ObjectKey(b"x"), size_bytes=1, checksum=b"0" * 16)],
            ),
            0,
        )
    with pytest.raises(BatchTooLarge):
        core.handle(m.Lookup(holder_id="h", groups=[GroupId(b"x")] * (m.LOOKUP_BATCH_GROUPS_MAX + 1)), 0)
    with pytest.raises(NotFound):
        core.handle(m.Heartbeat(segment_id="nope", incarnation=1, used_bytes=0), 0)


def test_queries_list_without_granting_leases() -> None:
    core = new_core()
    register(core, "s1")
    gs = groups(3)
    put(core, [key(g) for g in gs])
    segs = core.handle(m.ListSegments(), 0).reply
    assert isinstance(segs, m.SegmentList)
    assert [s.segment_id for s in segs.segments] == ["s1"] and segs.segments[0].reserved_bytes == 300
    page1 = core.handle(m.ListGroups(limit=2), 0).reply
    assert isinstance(page1, m.GroupList)
    assert len(page1.groups) == 2 and page1.next_after
    page2 = core.handle(m.ListGroups(limit=2, after=page1.next_after), 0).reply
    assert isinstance(page2, m.GroupList)
    assert len(page2.groups) == 1 and not page2.next_after
    other = core.handle(m.ListGroups(domain_digest=DomainDigest(b"\x00" * 16)), 0).reply
    assert isinstance(other, m.GroupList) and not other.groups
    shown = core.handle(m.ShowGroup(group=gs[1].to_bytes()), 0).reply
    assert isinstance(shown, m.GroupList)
    assert shown.groups[0].chunk_index == 1 and shown.groups[0].objects[0].size_bytes == 100
    leases = core.handle(m.ListLeases(), 0).reply
    assert isinstance(leases, m.LeaseList) and not leases.leases
    with pytest.raises(NotFound):
        core.handle(m.ShowGroup(group=b"\x01" * 32), 0)


def test_retried_confirm_after_publish_does_not_tell_the_segment_to_free_a_readable_slot() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    begin = core.handle(m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(g))]), 0).reply
    assert isinstance(begin, m.PutBeginReply)
    confirm_all(core, begin, 0)
    core.handle(m.PutCommit(writer_id="w", request_id="c", keys=[key(g)]), 0)
    t = begin.results[0].tickets[0]
    retried = core.handle(
        m.ConfirmReplicas(
            segment_id="s1",
            incarnation=1,
            confirms=[
                m.ReplicaConfirm(
                    ticket_id=t.ticket_id,
                    key=t.key,
                    slot=0,
                    slot_generation=1,
                    size_bytes=100,
                    checksum=t.checksum,
                )
            ],
        ),
        5,
    ).reply
    assert isinstance(retried, m.ConfirmReply)
    assert retried.results[0].status == "ok"
    assert lookup(core, [g], now=5).hit_chunks == 1


def test_published_event_tells_eviction_the_parent_tenant_and_bytes_per_segment() -> None:
    core = new_core(replicas_default=2)
    register(core, "s1", zone="z1")
    register(core, "s2", zone="z2")
    g0, g1 = groups(2)
    parent = g0.chain_hash
    begin = core.handle(
        m.PutBegin(
            writer_id="w",
            request_id="r",
            objects=[m.ObjectSpec(key=key(g1), size_bytes=300, checksum=b"c" * 16, parent=parent)],
        ),
        0,
    ).reply
    assert isinstance(begin, m.PutBeginReply)
    confirm_all(core, begin, 0)
    out = core.handle(m.PutCommit(writer_id="w", request_id="c", keys=[key(g1)]), 0)
    (batch,) = [e.event for e in out.effects if isinstance(e, EmitEvent)]
    assert isinstance(batch, m.GroupsPublished)  # one commit, one event
    (event,) = batch.groups
    assert event.parent == parent and event.chunk_index == 1
    assert event.namespace == g1.to_bytes()[:54] and event.namespace[4:20] == bytes(g1.domain_digest)
    assert event.placements == [m.SegmentBytes("s1", 300), m.SegmentBytes("s2", 300)]
    with pytest.raises(BadRequest):  # a parent is a chain hash or nothing
        core.handle(
            m.PutBegin(
                writer_id="w",
                request_id="r2",
                objects=[
                    m.ObjectSpec(key=key(g0), size_bytes=1, checksum=b"c" * 16, parent=ChainHash(b"short"))
                ],
            ),
            0,
        )


def test_lookup_hits_are_batched_into_one_accessed_event_per_tick() -> None:
    core = new_core()
    register(core, "s1")
    gs = groups(3)
    put(core, [key(g) for g in gs])
    assert lookup(core, gs).hit_chunks == 3
    assert lookup(core, gs[:1], holder="other").hit_chunks == 1
    assert lookup(core, groups(1, seed=9)).hit_chunks == 0  # a miss is no access
    events = [e.event for e in core.tick(1) if isinstance(e, EmitEvent)]
    assert events == [
        m.GroupsAccessed(
            groups=[
                m.GroupHits(gs[0].chain_hash, 2, gs[0].domain_digest),
                m.GroupHits(gs[1].chain_hash, 1, gs[1].domain_digest),
                m.GroupHits(gs[2].chain_hash, 1, gs[2].domain_digest),
            ]
        )
    ]
    assert not [e for e in core.tick(2) if isinstance(e, EmitEvent)]  # nothing new: nothing sent


def test_a_services_own_lookup_is_no_read() -> None:
    """Prefetch resolves a hint with a lookup: counted as a read, each hinted prefix looked read
    twice (hot replicas made, eviction ranks raised; review, stop 70). `count_hits=False`."""
    core = new_core()
    register(core, "s1")
    gs = groups(2)
    put(core, [key(g) for g in gs])
    hint = m.Lookup(holder_id="prefetch-p1", groups=[g.group_id() for g in gs], count_hits=False)
    reply = core.handle(hint, 0).reply
    assert isinstance(reply, m.LookupReply) and reply.hit_chunks == 2
    assert not [e for e in core.tick(1) if isinstance(e, EmitEvent)]  # no `accessed`
    assert lookup(core, gs[:1]).hit_chunks == 1  # an engine's read still counts
    assert [e.kind for e in core.tick(2) if isinstance(e, EmitEvent)] == ["accessed"]


def test_a_new_leader_adopts_complete_groups_and_frees_nothing_during_the_grace_period() -> None:
    from kvfabric.core.directory.rebuild import SegmentHolding
    from kvfabric.proto.segment import HeldObject

    core = new_core(lease_ttl_ms_max=500, replicas_default=2)
    g0, g1 = groups(2)  # g0 complete on two segments; g1 (2 ranks) has only rank 0
    (half,) = groups(1, seed=5, tp_size=2)

    def reg(seg: str, zone: str) -> m.RegisterSegment:
        return m.RegisterSegment(
            segment_id=seg,
            incarnation=7,
            capacity_bytes=10_000,
            domain=m.FailureDomain(host=seg, zone=zone),
            data_addr=f"tcp://{seg}",
        )

    good = b"g" * 16
    holdings = [
        SegmentHolding(
            reg("s1", "z1"),
            [
                HeldObject(key(g0), 1, 3, 100, good),
                HeldObject(key(g1), 2, 1, 100, good),
                HeldObject(key(half, rank=0), 3, 1, 50, good),  # its group never completed
                HeldObject(ObjectKey(b"not a key"), 4, 1, 10, good),
            ],
        ),
        SegmentHolding(
            reg("s2", "z2"),
            [HeldObject(key(g0), 9, 2, 100, good), HeldObject(key(g1), 8, 1, 100, b"x" * 16)],  # g1 disagrees
        ),
    ]
    effects = core.adopt(holdings, now_ms=1_000)
    assert effects == []  # the orphans wait out the grace period
    hit = lookup(core, [g0, g1], now=1_000)
    assert hit.hit_chunks == 1  # g1's replicas disagree: which one was committed is not known
    assert sorted((r.segment_id, r.slot, r.slot_generation) for r in hit.objects[0].replicas) == [
        ("s1", 1, 3),
        ("s2", 9, 2),
    ]
    assert lookup(core, [g1], now=1_000).hit_chunks == 0
    assert lookup(core, [half]).hit_chunks == 0
    core.handle(m.LeaseRelease(holder_id="reader", lease_id=hit.lease_id), 1_000)
    evicted = core.handle(m.Evict(groups=[g0.group_id()]), 1_100)
    assert evicted.effects and not [e for e in evicted.effects if isinstance(e, FreeSlots)]
    assert not [e for e in core.tick(1_499) if isinstance(e, FreeSlots)]
    frees = [e for e in core.tick(1_500) if isinstance(e, FreeSlots)]
    freed = sorted((f.segment_id, s.slot) for f in frees for s in f.slots)
    # g0 (evicted) + 4 orphans: both replicas of the disputed g1, the incomplete group, the bad key
    assert freed == [("s1", 1), ("s1", 2), ("s1", 3), ("s1", 4), ("s2", 8), ("s2", 9)]
    assert core.counters["adopted_groups_total"] == 1 and core.counters["adopted_orphans_total"] == 4
    core.check_invariants()


def test_orphans_stay_held_past_the_grace_while_a_rebuild_for_a_missing_segment_is_pending() -> None:
    """A group whose rank 1 is only on a segment that missed the report is an orphan here; the
    host, rebuilding later for that segment (backed off past the grace), holds the orphans:
    other frees of adopted slots go when the grace ends, the orphan's not, and the rebuild that
    hears the late segment adopts the group whole (review, stop 65: its rank 0 was freed)."""
    from kvfabric.core.directory.rebuild import SegmentHolding
    from kvfabric.proto.segment import HeldObject

    def reg(seg: str) -> m.RegisterSegment:
        return m.RegisterSegment(
            segment_id=seg, incarnation=7, capacity_bytes=10_000,
            domain=m.FailureDomain(host=seg, zone=seg), data_addr=f"tcp://{seg}",
        )  # fmt: skip

    good = b"g" * 16
    (g0,) = groups(1)
    (split,) = groups(1, seed=5, tp_size=2)  # rank 0 on s1, rank 1 on late s2
    on_s1 = SegmentHolding(
        reg("s1"), [HeldObject(key(g0), 1, 3, 100, good), HeldObject(key(split, rank=0), 2, 1, 50, good)]
    )
    on_s2 = SegmentHolding(reg("s2"), [HeldObject(key(split, rank=1), 5, 1, 50, good)])
    core = new_core(lease_ttl_ms_max=500)
    assert core.adopt([on_s1], now_ms=1_000) == []
    assert core.hold_orphans() == 1
    core.handle(m.Evict(groups=[g0.group_id()]), 1_100)  # an adopted slot freed in the grace
    frees = [e for e in core.tick(1_500) if isinstance(e, FreeSlots)]
    assert [(f.segment_id, s.slot) for f in frees for s in f.slots] == [("s1", 1)]  # not the orphan
    assert core.counters["orphan_frees_held_total"] == 1
    for now in (2_000, 60_000, 600_000):
        assert not [e for e in core.tick(now) if isinstance(e, FreeSlots)]
        core.check_invariants()
    rebuilt = new_core(lease_ttl_ms_max=500)  # the rebuild: a new core, every segment's report
    rebuilt.adopt([on_s1, on_s2], now_ms=600_000)
    assert lookup(rebuilt, [split], now=600_000).hit_chunks == 1
    unheld = new_core(lease_ttl_ms_max=500)  # without the hold the orphan goes with the grace
    unheld.adopt([on_s1], now_ms=1_000)
    frees = [e for e in unheld.tick(1_500) if isinstance(e, FreeSlots)]
    assert [(f.segment_id, s.slot) for f in frees for s in f.slots] == [("s1", 2)]
    assert unheld.hold_orphans() == 0  # too late: sent
    unheld.check_invariants()


def test_leases_are_shortened_to_the_longest_a_new_leader_waits_for() -> None:
    core = new_core(lease_ttl_ms_max=500)
    register(core, "s1")
    (g,) = groups(1)
    put(core, [key(g)])
    assert lookup(core, [g], now=0, ttl=60_000).lease_expires_ms == 500


def confirm_ticket(core: DirectoryCore, t: m.WriteTicket, slot: int, now: int = 0) -> str:
    reply = core.handle(
        m.ConfirmReplicas(
            segment_id=t.segment_id,
            incarnation=t.incarnation,
            confirms=[
                m.ReplicaConfirm(
                    ticket_id=t.ticket_id,
                    key=t.key,
                    slot=slot,
                    slot_generation=1,
                    size_bytes=t.size_bytes,
                    checksum=t.checksum,
                )
            ],
        ),
        now,
    ).reply
    assert isinstance(reply, m.ConfirmReply)
    return reply.results[0].status


def test_an_extra_replica_is_copied_into_place_and_joins_the_published_record() -> None:
    core = new_core(replicas_default=2)
    register(core, "s1", zone="z1")
    (g,) = groups(1)
    put(core, [key(g)])  # only s1 exists: published degraded, one replica
    assert [s.group for s in list_below(core)] == [bytes(g.chain_hash)]
    register(core, "s2", zone="z2")
    begin = core.handle(m.ReplicateBegin(writer_id="repair", request_id="r", key=key(g), segment_id="s2"), 0)
    reply = begin.reply
    assert isinstance(reply, m.ReplicateBeginReply) and reply.status == "placed" and reply.ticket is not None
    assert [r.segment_id for r in reply.sources] == ["s1"]
    assert ticket_signature_valid(reply.ticket, SECRET)
    again = core.handle(m.ReplicateBegin(writer_id="repair", request_id="r2", key=key(g), segment_id="s2"), 0)
    assert isinstance(again.reply, m.ReplicateBeginReply) and again.reply.status == "placed"
    assert again.reply.ticket == reply.ticket  # a retry gets the same ticket, not a second reservation
    core.check_invariants()
    assert confirm_ticket(core, reply.ticket, slot=40) == "ok"
    assert confirm_ticket(core, reply.ticket, slot=41) == "unknown_ticket"  # the slower copy is freed
    done = core.handle(m.ReplicateBegin(writer_id="repair", request_id="r3", key=key(g), segment_id="s2"), 0)
    assert isinstance(done.reply, m.ReplicateBeginReply) and done.reply.status == "already_there"
    hit = lookup(core, [g])
    assert sorted(r.segment_id for r in hit.objects[0].replicas) == ["s1", "s2"]
    assert list_below(core) == []  # back at its target
    core.check_invariants()


def test_an_unconfirmed_extra_replica_expires_and_a_late_confirm_is_refused() -> None:
    core = new_core(replicas_default=2)
    register(core, "s1", zone="z1")
    register(core, "s2", zone="z2")
    (g,) = groups(1)
    put(core, [key(g)])
    gone = core.handle(
        m.ReplicateBegin(writer_id="w", request_id="x", key=key(groups(1, seed=3)[0]), segment_id="s2"), 0
    )
    assert isinstance(gone.reply, m.ReplicateBeginReply) and gone.reply.status == "not_found"
    reply = core.handle(
        m.ReplicateBegin(writer_id="w", request_id="r", key=key(g), segment_id="s1", write_ttl_ms=100), 0
    ).reply
    assert isinstance(reply, m.ReplicateBeginReply) and reply.status == "already_there"  # s1 holds it
    core2 = new_core(replicas_default=2)
    register(core2, "s1", zone="z1")
    put(core2, [key(g)])
    register(core2, "s2", zone="z2", capacity=50)
    full = core2.handle(m.ReplicateBegin(writer_id="w", request_id="r", key=key(g), segment_id="s2"), 0).reply
    assert isinstance(full, m.ReplicateBeginReply) and full.status == "no_capacity"
    register(core2, "s3", zone="z3")
    placed = core2.handle(
        m.ReplicateBegin(writer_id="w", request_id="r", key=key(g), segment_id="s3", write_ttl_ms=100), 0
    ).reply
    assert isinstance(placed, m.ReplicateBeginReply) and placed.ticket is not None
    core2.tick(100)
    core2.check_invariants()
    assert confirm_ticket(core2, placed.ticket, slot=9, now=150) == "unknown_ticket"
    assert core2.counters["replica_tickets_expired_total"] == 1


def test_a_corrupt_replica_is_dropped_and_a_lost_last_replica_invalidates_the_group() -> None:
    core = new_core(replicas_default=2)
    register(core, "s1", zone="z1")
    register(core, "s2", zone="z2")
    (g,) = groups(1)
    put(core, [key(g)])
    hit = lookup(core, [g])
    (a, b) = hit.objects[0].replicas
    core.handle(m.LeaseRelease(holder_id="reader", lease_id=hit.lease_id), 0)

    def corrupt(r: m.Replica) -> Outcome:
        return core.handle(
            m.ReplicaCorrupt(
                segment_id=r.segment_id,
                incarnation=r.incarnation,
                key=key(g),
                slot=r.slot,
                slot_generation=r.slot_generation,
            ),
            0,
        )

    first = corrupt(a)
    assert isinstance(first.reply, m.ReplicaCorruptReply) and first.reply.dropped
    assert [f.segment_id for f in first.effects if isinstance(f, FreeSlots)] == [a.segment_id]
    second = lookup(core, [g], holder="r2")
    assert [r.segment_id for r in second.objects[0].replicas] == [b.segment_id]
    again = corrupt(a).reply
    assert isinstance(again, m.ReplicaCorruptReply) and not again.dropped
    core.handle(m.LeaseRelease(holder_id="r2", lease_id=second.lease_id), 0)
    corrupt(b)
    events = [e.event for e in core.tick(1) if isinstance(e, EmitEvent)]
    assert any(isinstance(ev, m.GroupInvalidated) for ev in events)
    assert lookup(core, [g], holder="r3").hit_chunks == 0
    core.check_invariants()


def list_below(core: DirectoryCore) -> list[m.GroupSummary]:
    reply = core.handle(m.ListGroups(below_target=True, with_objects=True), 0).reply
    assert isinstance(reply, m.GroupList)
    return reply.groups


def test_a_failed_copy_is_aborted_and_its_reservation_comes_back_at_once() -> None:
    core = new_core(replicas_default=2)
    register(core, "s1", zone="z1")
    (g,) = groups(1)
    put(core, [key(g)])
    register(core, "s2", zone="z2")
    placed = core.handle(
        m.ReplicateBegin(writer_id="repair", request_id="r", key=key(g), segment_id="s2"), 0
    ).reply
    assert isinstance(placed, m.ReplicateBeginReply) and placed.ticket is not None
    assert core.segments["s2"].reserved_bytes == 100
    other = core.handle(m.PutAbort(writer_id="someone-else", request_id="a0", keys=[key(g)]), 0).reply
    assert isinstance(other, m.PutAbortReply) and other.aborted == 0  # only its writer may abort it
    aborted = core.handle(m.PutAbort(writer_id="repair", request_id="a1", keys=[key(g)]), 0).reply
    assert isinstance(aborted, m.PutAbortReply) and aborted.aborted == 1
    assert core.segments["s2"].reserved_bytes == 0
    assert confirm_ticket(core, placed.ticket, slot=3) == "unknown_ticket"  # a late copy is freed
    core.check_invariants()


def test_an_identity_conflict_refuses_the_whole_put_begin_before_placing_anything() -> None:
    core = new_core()
    register(core, "s1")
    a, b = groups(2, seed=91)
    first = core.handle(m.PutBegin(writer_id="w", request_id="r1", objects=[spec(key(a))]), 0).reply
    assert isinstance(first, m.PutBeginReply) and first.results[0].status == "placed"
    # same domain + chain, another model
    other_model = ObjectKey(key(a)[:20] + bytes(b ^ 0xFF for b in key(a)[20:36]) + key(a)[36:])
    pending, reserved = core.pending_objects, core.segments["s1"].reserved_bytes
    with pytest.raises(BadRequest, match="conflicts"):
        core.handle(m.PutBegin(writer_id="w", request_id="r2", objects=[spec(key(b)), spec(other_model)]), 0)
    assert (core.pending_objects, core.segments["s1"].reserved_bytes) == (pending, reserved)  # b not placed
    core.check_invariants()


def test_a_second_save_of_a_chunk_by_the_same_writer_is_in_flight_not_handed_the_same_tickets() -> None:
    """One client (one writer id) saving a chunk twice at once (two prompts sharing a system
    prompt): were the second put_begin handed the first's tickets, both would write, each into
    a slot of its own, and the directory would keep one slot and lose track of the other."""
    core = new_core(replicas_default=1)
    register(core, "s1")
    (g,) = groups(1)
    k = key(g)
    first = core.handle(m.PutBegin(writer_id="w", request_id="save-a", objects=[spec(k)]), 0).reply
    second = core.handle(m.PutBegin(writer_id="w", request_id="save-b", objects=[spec(k)]), 0).reply
    assert isinstance(first, m.PutBeginReply) and isinstance(second, m.PutBeginReply)
    assert first.results[0].status == "placed"
    assert second.results[0].status == "in_flight" and not second.results[0].tickets
    # the same key twice in one request (two saves' items sharing one put_begin): placed once
    (h,) = groups(1, seed=1)
    both = core.handle(
        m.PutBegin(writer_id="w", request_id="shared", objects=[spec(key(h)), spec(key(h))]), 0
    ).reply
    assert isinstance(both, m.PutBeginReply)
    assert [r.status for r in both.results] == ["placed", "in_flight"]
    # the first save goes on alone: one slot written, confirmed, published
    confirm_all(core, first, 0)
    commit = core.handle(m.PutCommit(writer_id="w", request_id="c", keys=[k]), 0).reply
    assert isinstance(commit, m.PutCommitReply) and commit.results[0].status == "published"

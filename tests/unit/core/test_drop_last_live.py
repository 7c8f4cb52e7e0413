"""A healthy replica nobody needs (a cold extra, a drained one) is dropped only while another
live replica is left (review, 2026-12-05): a replica of a segment declared down stays in the
record until the sweep reaches its group, and counting it let prefetch drop the only live copy
(its original's segment had just died): the object was lost."""

from __future__ import annotations

import pytest

from kvfabric.core.directory import DirectoryCore, Effect, EmitEvent
from kvfabric.core.directory import replicas as replicas_module
from kvfabric.core.directory.replicas import TOKEN_SKEW_MS_MAX
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import confirm_ticket, groups, key, lookup, new_core, put, register


def test_a_cold_extra_is_not_dropped_while_the_other_replica_is_on_a_dead_segment() -> None:
    core = new_core(sweep_batch_max=1, heartbeat_timeout_ms=1_000)
    register(core, "s1", capacity=10_000)
    register(core, "s2", capacity=10_000)
    gs = groups(2, seed=51)
    keys = [key(g) for g in gs]
    put(core, keys)  # one replica each (the largest segment)
    extras = {}
    for k in keys:  # an extra on the other segment, as prefetch makes for a hot object
        begun = core.handle(
            m.ReplicateBegin(writer_id="prefetch", request_id=f"x-{k.hex()}", key=k, segment_id="s2"), 1
        ).reply
        if not isinstance(begun, m.ReplicateBeginReply) or begun.status != "placed":
            begun = core.handle(
                m.ReplicateBegin(writer_id="prefetch", request_id=f"y-{k.hex()}", key=k, segment_id="s1"), 1
            ).reply
        assert isinstance(begun, m.ReplicateBeginReply) and begun.status == "placed" and begun.ticket
        t = begun.ticket
        confirmed = core.handle(
            m.ConfirmReplicas(
                segment_id=t.segment_id,
                incarnation=1,
                confirms=[
                    m.ReplicaConfirm(
                        ticket_id=t.ticket_id,
                        key=t.key,
                        slot=900,
                        slot_generation=1,
                        size_bytes=t.size_bytes,
                        checksum=t.checksum,
                    )
                ],
            ),
            1,
        ).reply
        assert isinstance(confirmed, m.ConfirmReply) and confirmed.results[0].status == "ok"
        extras[k] = t.segment_id
    # the originals' segment dies: only the extras' segment heartbeats
    dead = {"s1": "s2", "s2": "s1"}[next(iter(extras.values()))]
    alive = extras[keys[0]]
    for now in (500, 1_200):  # down at 1,200; the sweep then takes one group a tick
        core.handle(m.Heartbeat(segment_id=alive, incarnation=1, used_bytes=0), now)
        core.tick(now)
    assert not core.segments[dead].up
    for k in keys:  # one group swept, one not yet (one a tick): neither extra may go
        out = core.handle(
            m.ReplicaCorrupt(
                segment_id=alive, incarnation=1, key=k, slot=900, slot_generation=1, reason="cold_extra"
            ),
            1_200,
        ).reply
        assert isinstance(out, m.ReplicaCorruptReply) and not out.dropped, k
    core.check_invariants()


def _extra_on(core: DirectoryCore, k: ObjectKey, segment: str) -> None:
    """An extra replica of `k` on `segment`, as prefetch makes for a hot object (slot 900)."""
    begun = core.handle(
        m.ReplicateBegin(writer_id="prefetch", request_id=f"x-{k.hex()}", key=k, segment_id=segment), 1
    ).reply
    assert isinstance(begun, m.ReplicateBeginReply) and begun.status == "placed" and begun.ticket
    confirm_ticket(core, begun.ticket, 900, 1)


def _drop_replica(core: DirectoryCore, k: ObjectKey, r: m.Replica, now: int, reason: str = "drained") -> bool:
    """A service's drop of replica `r` of `k` (repair's `drained`, by default): whether it went."""
    out = core.handle(
        m.ReplicaCorrupt(
            segment_id=r.segment_id,
            incarnation=1,
            key=k,
            slot=r.slot,
            slot_generation=r.slot_generation,
            reason=reason,
        ),
        now,
    ).reply
    assert isinstance(out, m.ReplicaCorruptReply)
    return out.dropped


def _drop_cold(core: DirectoryCore, k: ObjectKey, segment: str) -> tuple[bool, list[Effect]]:
    """Prefetch's drop of that extra: whether it was dropped, and the effects."""
    out = core.handle(
        m.ReplicaCorrupt(
            segment_id=segment, incarnation=1, key=k, slot=900, slot_generation=1, reason="cold_extra"
        ),
        2,
    )
    assert isinstance(out.reply, m.ReplicaCorruptReply)
    return out.reply.dropped, list(out.effects)


def test_a_cold_extra_is_not_dropped_when_the_object_would_go_below_its_target() -> None:
    """Target 2, copies on s1 and s2, an extra on s3: dropped while both originals are healthy;
    kept, an ordinary replica now, once one of them drains (or dies): dropped, the object went
    below target and repair copied it again (review, stop 65)."""
    core = new_core(replicas_default=2)
    for seg in ("s1", "s2", "s3"):
        register(core, seg, capacity=10_000, zone=seg)
    ka, kb = (key(g) for g in groups(2, seed=52))
    put(core, [ka, kb])
    placed: dict[ObjectKey, set[str]] = {}
    for k in (ka, kb):
        shown = core.handle(m.ShowGroup(group=k[:90]), 1).reply
        assert isinstance(shown, m.GroupList)
        placed[k] = {r.segment_id for r in shown.groups[0].objects[0].replicas}
    spare = {k: ({"s1", "s2", "s3"} - placed[k]).pop() for k in (ka, kb)}
    for k in (ka, kb):
        _extra_on(core, k, spare[k])
    assert _drop_cold(core, ka, spare[ka])[0]  # still an extra: both originals healthy
    drained = sorted(placed[kb])[0]
    core.handle(m.Heartbeat(segment_id=drained, incarnation=1, used_bytes=0, draining=True), 2)
    dropped, effects = _drop_cold(core, kb, spare[kb])
    assert not dropped  # one original draining: no extra any more
    # published again with it: the eviction policy's pools count the replica it now is
    (event,) = [e.event for e in effects if isinstance(e, EmitEvent)]
    assert isinstance(event, m.GroupPublished) and spare[kb] in {p.segment_id for p in event.placements}
    assert core.counters["drop_refused_below_target_total"] == 1
    core.check_invariants()


def test_a_drained_replica_is_not_dropped_while_a_read_lease_holds_its_group() -> None:
    """Repair drops a draining segment's replica once the object has its target elsewhere; a
    reader that looked the group up before the copy was made may hold tokens naming only that
    replica: freed under its lease, the reader's load missed (invariant 3; review, stop 67). Now
    refused while a read lease holds the group, and dropped once it is given back."""
    core = new_core(replicas_default=1)
    for seg in ("s1", "s2"):
        register(core, seg, capacity=10_000, zone=seg)
    (g,) = groups(1, seed=53)
    k = key(g)
    put(core, [k])
    shown = core.handle(m.ShowGroup(group=k[:90]), 1).reply
    assert isinstance(shown, m.GroupList)
    (original,) = shown.groups[0].objects[0].replicas
    leased = lookup(core, [g], now=1)  # the reader's tokens name the original only
    assert leased.lease_id
    core.handle(m.Heartbeat(segment_id=original.segment_id, incarnation=1, used_bytes=0, draining=True), 2)
    _extra_on(core, k, ({"s1", "s2"} - {original.segment_id}).pop())  # repair's copy

    assert not _drop_replica(core, k, original, 3) and core.counters["drop_refused_leased_total"] == 1
    core.handle(m.LeaseRelease(holder_id="reader", lease_id=leased.lease_id, shard=0), 3)
    assert _drop_replica(core, k, original, 3)  # the reader gave it back: the drain goes on
    core.check_invariants()


def test_readers_hold_a_drained_replica_up_no_longer_than_their_tokens_live() -> None:
    """Leases taken and renewed one after another (a hot group, or a tenant renewing one on
    purpose) kept a drained replica for good, and the drain never ended (review of the fix,
    stop 67): it waits `lease_ttl_ms_max` + the segments' skew tolerance from its first refusal
    at most, when every token from before the copy has expired."""
    core = new_core(replicas_default=1)
    for seg in ("s1", "s2"):
        register(core, seg, capacity=10_000, zone=seg)
    (g,) = groups(1, seed=54)
    k = key(g)
    put(core, [k])
    shown = core.handle(m.ShowGroup(group=k[:90]), 1).reply
    assert isinstance(shown, m.GroupList)
    (original,) = shown.groups[0].objects[0].replicas
    core.handle(m.Heartbeat(segment_id=original.segment_id, incarnation=1, used_bytes=0, draining=True), 2)
    _extra_on(core, k, ({"s1", "s2"} - {original.segment_id}).pop())
    wait_ms = core.config.lease_ttl_ms_max + TOKEN_SKEW_MS_MAX
    dropped_at = None
    for now in range(10, 3 * wait_ms, 5_000):  # a fresh lease every 5 s, each living 30 s
        alive = ({"s1", "s2"} - {original.segment_id}).pop()
        core.handle(m.Heartbeat(segment_id=alive, incarnation=1, used_bytes=0), now)
        core.handle(
            m.Heartbeat(segment_id=original.segment_id, incarnation=1, used_bytes=0, draining=True), now
        )
        core.tick(now)
        lookup(core, [g], now=now, holder=f"reader{now}", ttl=30_000)
        if _drop_replica(core, k, original, now):
            dropped_at = now
            break
    assert dropped_at is not None and wait_ms <= dropped_at - 10 < wait_ms + 5_000
    core.check_invariants()


def test_a_refusal_for_one_replica_leaves_no_clock_for_another() -> None:
    """The wait was kept per group, and an entry whose replica went otherwise (dropped as
    corrupt) stayed: a later drain of another replica of the group, under a reader whose tokens
    name only it, was dropped at once on the old clock (review of the fix, stop 67). Kept per
    replica now, and forgotten at twice the wait."""
    core = new_core(replicas_default=1)
    for seg in ("s1", "s2", "s3"):
        register(core, seg, capacity=10_000, zone=seg)
    (g,) = groups(1, seed=77)
    k = key(g)
    put(core, [k])

    def replicas() -> list[m.Replica]:
        shown = core.handle(m.ShowGroup(group=k[:90]), 1).reply
        assert isinstance(shown, m.GroupList)
        return list(shown.groups[0].objects[0].replicas)

    def beat(now: int, draining: str = "") -> None:
        for seg in ("s1", "s2", "s3"):
            core.handle(
                m.Heartbeat(segment_id=seg, incarnation=1, used_bytes=0, draining=seg == draining), now
            )

    def drop(r: m.Replica, now: int, reason: str = "drained") -> bool:
        return _drop_replica(core, k, r, now, reason)

    (a,) = replicas()
    b_seg, c_seg = sorted({"s1", "s2", "s3"} - {a.segment_id})
    _extra_on(core, k, b_seg)
    lease = lookup(core, [g], now=2, holder="reader1", ttl=1_000)
    beat(2, draining=a.segment_id)
    assert not drop(a, 3)  # refused under reader1's lease
    core.handle(m.LeaseRelease(holder_id="reader1", lease_id=lease.lease_id, shard=0), 3)
    beat(4)
    assert drop(a, 4, reason="corrupt")  # A goes otherwise: its wait is never asked again
    later = 100_000  # past the wait, within twice it
    beat(later)
    tokens = lookup(core, [g], now=later, holder="reader2", ttl=60_000)  # naming B only
    assert {r.segment_id for o in tokens.objects for r in o.replicas} == {b_seg}
    beat(later + 1, draining=b_seg)
    begun = core.handle(
        m.ReplicateBegin(writer_id="repair", request_id="copy-2", key=k, segment_id=c_seg), later + 2
    ).reply
    assert isinstance(begun, m.ReplicateBeginReply) and begun.ticket
    confirm_ticket(core, begun.ticket, 901, later + 2)
    (b,) = [r for r in replicas() if r.segment_id == b_seg]
    assert not drop(b, later + 3)  # reader2 may hold tokens naming only B: it waits
    core.check_invariants()


def test_past_the_bound_on_waiting_drains_a_drop_is_refused_not_let_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past `DRAIN_WAITS_MAX` drained replicas waiting, a new one was dropped at once, under
    the readers the wait protects (review of the fix, stop 67): it is refused, with no clock,
    until the oldest waits age out."""
    monkeypatch.setattr(replicas_module, "DRAIN_WAITS_MAX", 1)
    core = new_core(replicas_default=1)
    for seg in ("s1", "s2"):
        register(core, seg, capacity=10_000, zone=seg)
    gs = groups(2, seed=78)
    keys = [key(g) for g in gs]
    put(core, keys)
    originals = {}
    for k in keys:
        shown = core.handle(m.ShowGroup(group=k[:90]), 1).reply
        assert isinstance(shown, m.GroupList)
        (originals[k],) = shown.groups[0].objects[0].replicas
    lookup(core, gs, now=1, holder="reader", ttl=60_000)  # readers of both
    register(core, "s3", capacity=10_000, zone="s3")  # where repair copies them
    for r in originals.values():
        core.handle(m.Heartbeat(segment_id=r.segment_id, incarnation=1, used_bytes=0, draining=True), 2)
    for k in keys:
        _extra_on(core, k, "s3")

    def drop(k: ObjectKey, now: int) -> bool:
        return _drop_replica(core, k, originals[k], now)

    assert not drop(keys[0], 3)  # waiting, with its clock
    assert not drop(keys[1], 3)  # past the bound: refused, no clock (was: dropped at once)
    wait_ms = core.config.lease_ttl_ms_max + TOKEN_SKEW_MS_MAX
    assert drop(keys[0], 3 + wait_ms)  # its wait is over
    core.check_invariants()

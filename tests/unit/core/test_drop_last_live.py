"""A healthy replica nobody needs (a cold extra, a drained one) is dropped only while another
live replica is left (review, 2026-12-05): a replica of a segment declared down stays in the
record until the sweep reaches its group, and counting it let prefetch drop the only live copy
(its original's segment had just died): the object was lost."""

from __future__ import annotations

from kvfabric.proto import directory as m
from tests.unit.core.dirkit import groups, key, new_core, put, register


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

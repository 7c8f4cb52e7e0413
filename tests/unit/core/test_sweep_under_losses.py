"""The sweep reaches every group while segments keep dying (review, stop 68): each loss rebuilt
its queue in record order and the sweep takes from the end, so under losses more often than a
whole pass (a crash-looping segment) the oldest groups were never examined: their lost groups
stayed published for good (every re-save answered `exists`, every lookup missed) and the repair
listing's short index never covered. Now the groups still queued stay next in line."""

from __future__ import annotations

from kvfabric.core.directory.keys import parse_group
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import groups, key, lookup, new_core, put, register, spec


def test_a_crash_looping_segment_does_not_starve_the_oldest_groups() -> None:
    core = new_core(sweep_batch_max=50)
    register(core, "A", capacity=10**9)
    oldest = groups(20, seed=1)
    put(core, [key(g) for g in oldest], request_id="a")  # only on A
    register(core, "B", capacity=10**9)
    core.handle(m.Heartbeat(segment_id="A", incarnation=1, used_bytes=0, draining=True), 0)
    put(core, [key(g) for g in groups(480, seed=2)], request_id="b")  # on B
    register(core, "C", capacity=10**9)
    now = 100
    register(core, "A", now=now, incarnation=2)  # A restarted: the oldest 20 are lost
    incarnation = 1
    for i in range(60):  # C crash-loops: a new incarnation every 3 ticks (a pass takes 10)
        now += 100
        core.handle(m.Heartbeat(segment_id="A", incarnation=2, used_bytes=0), now)
        core.handle(m.Heartbeat(segment_id="B", incarnation=1, used_bytes=0), now)
        if i % 3 == 0:
            incarnation += 1
            register(core, "C", now=now, incarnation=incarnation)
        else:
            core.handle(m.Heartbeat(segment_id="C", incarnation=incarnation, used_bytes=0), now)
        core.tick(now)
        core.check_invariants()
    assert not any(parse_group(g.group_id()).group_id in core.published for g in oldest)
    assert all(lookup(core, [g], now=now, holder="x").hit_chunks == 0 for g in oldest)
    again = core.handle(m.PutBegin(writer_id="w9", request_id="z", objects=[spec(key(oldest[0]))]), now).reply
    assert isinstance(again, m.PutBeginReply) and again.results[0].status == "placed"

"""A directory that cannot hear (its NATS connection down) does not declare segments down for
their silence (review, 2026-12-05): on a NATS cluster a leader keeps acting for 12.5 s, longer
than the 5 s heartbeat timeout, and a disconnect of that long declared every segment down, each
then restarting empty. While deaf every up segment's silence is shifted by the time missed;
once it hears again, a segment that stays silent is declared down a timeout later."""

from __future__ import annotations

from kvfabric.proto import directory as m
from tests.unit.core.dirkit import new_core, register


def test_silence_while_deaf_is_excused_and_silence_after_is_not() -> None:
    core = new_core(heartbeat_timeout_ms=5_000)
    register(core, "s1")
    core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), 0)
    core.tick(0)
    for now in range(100, 10_001, 100):  # 10 s without NATS: ticking, hearing nothing
        core.tick(now, deaf=True)
    assert core.segments["s1"].up
    assert core.counters["segment_silence_excused_total"] == 100
    for now in range(10_100, 14_901, 100):  # heard again, but s1 stays silent: < 5 s
        core.tick(now)
    assert core.segments["s1"].up
    core.tick(15_200)  # 5.2 s of real silence: down
    assert not core.segments["s1"].up
    core.check_invariants()


def test_without_the_excuse_the_same_silence_is_a_segment_down() -> None:
    core = new_core(heartbeat_timeout_ms=5_000)
    register(core, "s1")
    core.handle(m.Heartbeat(segment_id="s1", incarnation=1, used_bytes=0), 0)
    for now in range(0, 10_001, 100):
        core.tick(now)
    assert not core.segments["s1"].up


def test_a_segment_declared_down_that_registers_again_is_not_lost_twice() -> None:
    """Declared down (silence), then registered with a new incarnation: only `segment_up` comes
    out of the registration. A second `segment_down` of the old incarnation came too, and each
    shard's reached the eviction policy after the new incarnation's groups (review, 2026-12-05);
    a live one that restarts is still lost once, then up."""
    from kvfabric.core.directory import EmitEvent

    core = new_core(heartbeat_timeout_ms=5_000)
    register(core, "s1")
    register(core, "s2")
    core.tick(0)
    downs = [e.event for e in core.tick(6_000) if isinstance(e, EmitEvent)]
    assert {(d.segment_id, d.incarnation) for d in downs if isinstance(d, m.SegmentDown)} == {
        ("s1", 1),
        ("s2", 1),
    }
    again = [
        e.event for e in register(core, "s1", now=6_100, incarnation=2).effects if isinstance(e, EmitEvent)
    ]
    assert [type(x).__name__ for x in again] == ["SegmentUp"]
    register(core, "s2", now=6_100, incarnation=2)
    restarted = [
        e.event for e in register(core, "s2", now=6_200, incarnation=3).effects if isinstance(e, EmitEvent)
    ]
    kinds = [(type(x).__name__, getattr(x, "incarnation", 0)) for x in restarted]
    assert kinds == [("SegmentDown", 2), ("SegmentUp", 3)]
    core.check_invariants()


def test_a_write_whose_every_placement_was_lost_frees_its_key() -> None:
    """A put_begin placed on the only segment, which is then declared down before the writer
    commits: its member goes (its key was `in_flight` for every other writer until the write's
    deadline; review, 2026-12-05), so another writer places it at once."""
    from tests.unit.core.dirkit import groups, key, spec

    core = new_core(heartbeat_timeout_ms=5_000)
    register(core, "s1")
    k = key(groups(1)[0])
    first = core.handle(m.PutBegin(writer_id="w1", request_id="r1", objects=[spec(k)]), 0).reply
    assert isinstance(first, m.PutBeginReply) and first.results[0].status == "placed"
    core.tick(0)
    core.tick(6_000)  # s1 silent: down, the write's only placement with it
    register(core, "s2", now=6_000)
    second = core.handle(m.PutBegin(writer_id="w2", request_id="r2", objects=[spec(k)]), 6_000).reply
    assert isinstance(second, m.PutBeginReply)
    assert second.results[0].status == "placed" and second.results[0].tickets[0].segment_id == "s2"
    core.check_invariants()


def test_a_core_rebuilt_at_the_same_epoch_never_reissues_an_id() -> None:
    """Ids are fenced by the epoch; a core rebuilt at the same epoch (the shard host starts it
    with `first_id` from the wall clock) starts its ids past the old core's, so a late confirm
    or release naming an old ticket or lease finds nothing (review, 2026-12-05: the new core's
    ticket N was ended by the old core's)."""
    from tests.unit.core.dirkit import groups, key, spec

    old = new_core()
    register(old, "s1")
    first = old.handle(m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(groups(1)[0]))]), 0).reply
    assert isinstance(first, m.PutBeginReply)
    from kvfabric.core.directory import DirectoryConfig, DirectoryCore
    from tests.unit.core.dirkit import SECRET

    rebuilt = DirectoryCore(DirectoryConfig(ticket_secret=SECRET), first_id=1 << 40)
    register(rebuilt, "s1")
    again = rebuilt.handle(
        m.PutBegin(writer_id="w", request_id="r", objects=[spec(key(groups(1)[0]))]), 0
    ).reply
    assert isinstance(again, m.PutBeginReply)
    assert again.results[0].tickets[0].ticket_id >= 1 << 40 > first.results[0].tickets[0].ticket_id

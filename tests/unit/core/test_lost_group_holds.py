"""A lost group (a member with no replica on a live incarnation) is held no longer than the holds
it had when lost: a pin skips it, a renew does not extend a lease holding it once deferred, and
the sweep invalidates it when those end. Meanwhile the repair listing's short index still covers
every repairable group (a deferred group is lost: nothing to repair, not listed below target).
Before (review): pinning it again every 15 s, or renewing a lease on it, kept it deferred for
ever, and `short_covers_below_target()` stayed False, so each below-target pass of the repair
service walked every group. `check_invariants` after each step."""

from __future__ import annotations

from kvfabric.core.directory import DirectoryCore, Effect, EmitEvent
from kvfabric.core.directory.keys import parse_group
from kvfabric.format.key import ChunkGroupId
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import confirm_all, groups, key, lookup, new_core, put, register, spec

PIN_TTL_MS = 20_000


def lost_on_s1() -> tuple[DirectoryCore, ChunkGroupId, ChunkGroupId]:
    """Group G's only replica is on s1, H's on s2 (replica target 1)."""
    core = new_core()
    register(core, "s1")
    g, h = groups(2, seed=7)
    put(core, [key(g)])
    register(core, "s2")
    put(core, [key(h)], request_id="r2")
    return core, g, h


def beat_until(core: DirectoryCore, start: int, end: int) -> list[Effect]:
    """s2 beats and the core ticks every second in (start, end]; s1 is silent. The effects."""
    effects: list[Effect] = []
    for t in range(start + 1_000, end + 1, 1_000):
        core.handle(m.Heartbeat(segment_id="s2", incarnation=1, used_bytes=0), t)
        effects += core.tick(t)
        core.check_invariants()
    return effects


def pin(core: DirectoryCore, g: ChunkGroupId, now: int) -> m.PinReply:
    reply = core.handle(m.Pin(holder_id="bob/h", groups=[g.group_id()], ttl_ms=PIN_TTL_MS), now).reply
    assert isinstance(reply, m.PinReply)
    core.check_invariants()
    return reply


def below_target(core: DirectoryCore, now: int) -> list[bytes]:
    """The chain hashes a below-target listing names."""
    page = core.handle(m.ListGroups(limit=100, below_target=True), now).reply
    assert isinstance(page, m.GroupList)
    return [s.group for s in page.groups]


def chain(g: ChunkGroupId) -> bytes:
    return parse_group(g.group_id()).group_id[16:]


def invalidated(effects: list[Effect]) -> int:
    return sum(isinstance(e, EmitEvent) and e.kind == "invalidated" for e in effects)


def test_a_pin_does_not_hold_a_lost_group_and_its_key_is_saved_again() -> None:
    """A pin gives nobody read tokens: a lost group that is only pinned is invalidated by the
    sweep at once. It was deferred until the pin ended (review, stop 68), and meanwhile every
    re-save of its keys answered `exists` while lookups missed: a pinned hot prefix recomputed
    by every request for up to a day. The pin then holds the key's next record."""
    core, g, _h = lost_on_s1()
    assert pin(core, g, 0).pinned_groups == 1
    effects = beat_until(core, 0, 7_000)  # s1 declared down: G lost and swept, pin or not
    assert not core.segments["s1"].up and invalidated(effects) == 1
    table = core.published_table
    assert lookup(core, [g], 7_000).hit_chunks == 0
    assert table.short_covers_below_target() and below_target(core, 7_000) == []
    again = pin(core, g, 7_000)  # nothing published to pin
    assert again.pinned_groups == 0 and again.pin_id == 0
    register(core, "s3")
    saved = put(core, [key(g)], now=7_000, request_id="again")  # placed and published, not `exists`
    assert [r.status for r in saved.results] == ["published"]
    assert lookup(core, [g], 7_000).hit_chunks == 1
    evicted = core.handle(m.Evict(groups=[g.group_id()]), 7_000).reply
    assert isinstance(evicted, m.EvictReply)
    assert [r.status for r in evicted.results] == ["pinned"]  # the first pin holds the new record
    core.check_invariants()


def test_a_lost_group_leased_and_pinned_is_swept_when_its_lease_ends() -> None:
    core, g, _h = lost_on_s1()
    assert pin(core, g, 0).pinned_groups == 1
    assert lookup(core, [g], 0, holder="bob/r", ttl=10_000).hit_chunks == 1
    effects = beat_until(core, 0, 7_000)  # G lost, deferred under the lease (not the pin)
    assert invalidated(effects) == 0 and core.published_table.deferred(parse_group(g.group_id()).group_id)
    effects = beat_until(core, 7_000, 11_000)  # the lease ended (the pin has 9 s left): swept
    assert invalidated(effects) == 1 and len(core.published) == 1
    core.check_invariants()


def test_a_renew_does_not_extend_a_lease_on_a_deferred_group() -> None:
    core, g, h = lost_on_s1()
    on_h = lookup(core, [h], 0, holder="bob/r", ttl=10_000)
    lease_g = lookup(core, [g], 0, holder="bob/r", ttl=10_000)
    assert on_h.hit_chunks == lease_g.hit_chunks == 1
    beat_until(core, 0, 7_000)  # G lost and deferred under the lease
    renewed = core.handle(
        m.LeaseRenew(holder_id="bob/r", lease_id=lease_g.lease_id, lease_ttl_ms=60_000), 8_000
    )
    assert renewed.reply == m.LeaseReply(epoch=1, lease_id=lease_g.lease_id, expires_ms=10_000)
    healthy = core.handle(m.LeaseRenew(holder_id="bob/r", lease_id=on_h.lease_id, lease_ttl_ms=60_000), 8_000)
    assert healthy.reply == m.LeaseReply(epoch=1, lease_id=on_h.lease_id, expires_ms=68_000)
    core.check_invariants()
    effects = beat_until(core, 8_000, 10_000)  # the lease ends where it did: G invalidated
    assert invalidated(effects) == 1 and len(core.published) == 1
    core.check_invariants()


def test_a_lookup_of_a_surviving_member_does_not_hold_a_lost_group() -> None:
    """TP 2, member 0 on s1, member 1 on s2; s1 goes silent under a lease. The rank of member 1
    asks for its own member only (the client's default): each lookup hit and took a new lease,
    and the group stayed deferred (never invalidated) for as long as it asked."""
    core = new_core()
    register(core, "s1", capacity=100)
    (g,) = groups(1, seed=3, tp_size=2)
    k0, k1 = key(g, 0), key(g, 1)
    begin = core.handle(m.PutBegin(writer_id="w", request_id="a", objects=[spec(k0, 100)]), 0).reply
    assert isinstance(begin, m.PutBeginReply)
    confirm_all(core, begin, 0)
    register(core, "s2")
    begin = core.handle(m.PutBegin(writer_id="w", request_id="b", objects=[spec(k1, 100)]), 0).reply
    assert isinstance(begin, m.PutBeginReply)
    confirm_all(core, begin, 0, slot_base=5)
    core.handle(m.PutCommit(writer_id="w", request_id="c", keys=[k0, k1]), 0)
    assert lookup(core, [g], 0, holder="bob/r", ttl=10_000).hit_chunks == 1
    hits = []
    effects: list[Effect] = []
    for t in range(1_000, 30_001, 1_000):
        core.handle(m.Heartbeat(segment_id="s2", incarnation=1, used_bytes=0), t)
        effects += core.tick(t)
        if t % 5_000 == 0:
            reply = core.handle(
                m.Lookup(
                    holder_id="bob/rank1",
                    groups=[g.group_id()],
                    members=[m.Member(1, 0, 0)],
                    lease_ttl_ms=10_000,
                ),
                t,
            ).reply
            assert isinstance(reply, m.LookupReply)
            hits.append(reply.hit_chunks)
        core.check_invariants()
    assert not core.segments["s1"].up and hits[2:] == [0] * (len(hits) - 2)  # lost from s1's death
    assert invalidated(effects) == 1 and len(core.published) == 0  # swept once the first lease ended

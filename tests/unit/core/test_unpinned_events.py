"""The directory tells the eviction policy when a group's last pin ends (`GroupsUnpinned`, stop
65): by the next tick, whether an unpin or the pin's expiry ended it, once per group per tick,
and not while another pin still holds the group. Before, the policy learned of an unpin only by
asking again, backing off pinned victims up to 80 s (docs/eviction-policy.md)."""

from __future__ import annotations

from kvfabric.core.directory import DirectoryCore
from kvfabric.core.directory.base import Effect, EmitEvent
from kvfabric.format.ids import GroupKey
from kvfabric.format.key import ChunkGroupId
from kvfabric.proto import directory as m

from .dirkit import groups, key, new_core, put, register


def unpinned(effects: list[Effect]) -> list[m.GroupRef]:
    events = [e.event for e in effects if isinstance(e, EmitEvent) and e.kind == "unpinned"]
    assert all(isinstance(event, m.GroupsUnpinned) for event in events)
    return [ref for event in events if isinstance(event, m.GroupsUnpinned) for ref in event.groups]


def ref(g: ChunkGroupId) -> m.GroupRef:
    return m.GroupRef(g.chain_hash, g.domain_digest)


def pin(core: DirectoryCore, gs: list[ChunkGroupId], ttl_ms: int = 1_000, now: int = 0) -> int:
    reply = core.handle(
        m.Pin(holder_id="reader", groups=[g.group_id() for g in gs], ttl_ms=ttl_ms), now
    ).reply
    assert isinstance(reply, m.PinReply) and reply.pin_id
    return reply.pin_id


def unpin(core: DirectoryCore, pin_id: int) -> None:
    out = core.handle(m.Unpin(holder_id="reader", pin_id=pin_id), 0)
    assert out.effects == []  # gathered for the tick: one event a tick, not one per unpin


def test_the_groups_an_unpin_was_the_last_pin_of_are_told_by_the_next_tick_once() -> None:
    core = new_core()
    register(core, "s1")
    gs = groups(3)
    put(core, [key(g) for g in gs])
    first = pin(core, [gs[0], gs[1], gs[0]])  # a group named twice: told once
    second = pin(core, [gs[1]])
    unpin(core, first)
    assert unpinned(core.tick(1)) == [ref(gs[0])]  # gs[1]: the second pin still holds it
    again = pin(core, [gs[0]])  # pinned and unpinned again within one tick: told once
    unpin(core, again)
    unpin(core, second)
    assert unpinned(core.tick(2)) == [ref(gs[0]), ref(gs[1])]
    assert unpinned(core.tick(3)) == []
    assert core.counters["groups_unpinned_total"] == 3
    core.check_invariants()


def test_a_pins_expiry_is_told_by_the_tick_that_ends_it_and_a_leases_end_never() -> None:
    core = new_core()
    register(core, "s1", now=0)
    gs = groups(2)
    put(core, [key(g) for g in gs])
    pin(core, [gs[0]], ttl_ms=1_000)
    lease = core.handle(m.Lookup(holder_id="reader", groups=[gs[1].group_id()]), 0).reply
    assert isinstance(lease, m.LookupReply) and lease.lease_id
    assert unpinned(core.tick(999)) == []
    assert unpinned(core.tick(1_000)) == [ref(gs[0])]
    assert lease.lease_expires_ms < 60_000
    assert unpinned(core.tick(60_000)) == []  # the lease expired: no word (leases never back off)
    assert core.counters["leases_expired_total"] == 1
    core.check_invariants()


def test_more_groups_than_an_event_holds_go_in_several() -> None:
    core = new_core()
    register(core, "s1")
    # (as many groups' last pins ending before one tick; 48-byte group keys: domain + chain hash)
    core.lease_table.unpinned = dict.fromkeys(
        GroupKey(bytes([i % 256, i // 256]) * 24) for i in range(m.ACCESS_BATCH_MAX + 1)
    )
    events = [e.event for e in core.tick(1) if isinstance(e, EmitEvent) and e.kind == "unpinned"]
    assert [len(e.groups) for e in events if isinstance(e, m.GroupsUnpinned)] == [m.ACCESS_BATCH_MAX, 1]

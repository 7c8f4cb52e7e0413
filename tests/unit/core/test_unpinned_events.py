"""The directory tells the eviction policy when a group's last pin ends (`GroupsUnpinned`, stop
65): an unpin's own effects carry it, a pin's expiry the tick's, once per group, and not while
another pin still holds the group. Before, the policy learned of an unpin only by asking again,
backing off pinned victims up to 80 s (docs/eviction-policy.md)."""

from __future__ import annotations

from kvfabric.core.directory import DirectoryCore
from kvfabric.core.directory.base import Effect, EmitEvent
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


def test_an_unpin_tells_the_groups_it_was_the_last_pin_of() -> None:
    core = new_core()
    register(core, "s1")
    gs = groups(3)
    put(core, [key(g) for g in gs])
    first = pin(core, [gs[0], gs[1], gs[0]])  # a group named twice: told once
    second = pin(core, [gs[1]])
    out = core.handle(m.Unpin(holder_id="reader", pin_id=first), 0)
    assert unpinned(out.effects) == [ref(gs[0])]  # gs[1]: the second pin still holds it
    out = core.handle(m.Unpin(holder_id="reader", pin_id=second), 0)
    assert unpinned(out.effects) == [ref(gs[1])]
    assert core.counters["groups_unpinned_total"] == 2
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
    assert unpinned(core.tick(60_000)) == []  # the lease expired: no word (leases never back off)
    core.check_invariants()

"""The eviction policy and one `published` event per put_commit (issue 20): a `GroupsPublished`
does to the core and the records what its groups as single `GroupPublished` events do."""

from __future__ import annotations

from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore
from kvfabric.eviction_policy.shell import EvictionShell, group_id_of
from kvfabric.format.ids import ChainHash, DomainDigest, Namespace
from kvfabric.proto import directory as m

NAMESPACE = Namespace(bytes(4) + b"A" * 16 + bytes(34))
A = DomainDigest(b"A" * 16)


def shell() -> EvictionShell:
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.25), {})
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    return sh


def chain(i: int) -> ChainHash:
    return ChainHash(i.to_bytes(32, "little"))


def published(i: int, placed: bool = True) -> m.GroupPublished:
    """Chunk i of one prefix (its parent chunk i - 1), 20 bytes on s1."""
    return m.GroupPublished(
        group=chain(i),
        chunk_index=i,
        members=1,
        namespace=NAMESPACE,
        parent=chain(i - 1) if i else ChainHash(b""),
        placements=[m.SegmentBytes("s1", 20)] if placed else [],
    )


def state(sh: EvictionShell) -> tuple[object, ...]:
    return (
        sorted(sh._group_ids.items()),
        sorted(sh._parent.items()),
        sorted((k, sorted(v)) for k, v in sh._children.items()),
        sh.core.used_bytes("s1"),
        sh.core.tenant_bytes(A),
        len(sh.core),
    )


def test_a_commits_event_inserts_its_groups_as_single_events_do() -> None:
    singles, batched = shell(), shell()
    for i in range(3):
        singles.apply(published(i), 1)
    batched.apply(m.GroupsPublished(groups=[published(i) for i in range(3)]), 1)
    assert state(batched) == state(singles)
    assert batched._group_ids[A + chain(2)] == group_id_of(NAMESPACE, 2, chain(2))
    assert batched.core.used_bytes("s1") == 60 and len(batched.core) == 3
    (victims,) = batched.core.tick(2)  # s1 at 60 % > 50 %: the prefix from its tail
    assert isinstance(victims, EvictBatch) and victims.victims[0] == A + chain(2)
    assert batched.events_applied == 2  # the segment_up and one commit's event
    batched.core.check_invariants()


def test_a_group_without_placements_in_the_event_is_skipped_and_the_rest_applied() -> None:
    sh = shell()
    sh.apply(m.GroupsPublished(groups=[published(0), published(1, placed=False), published(2)]), 1)
    assert sorted(sh._group_ids) == sorted([A + chain(0), A + chain(2)])
    assert sh.core.used_bytes("s1") == 40


def test_a_group_published_again_in_a_commits_event_moves_to_its_new_pools() -> None:
    sh = shell()
    sh.apply(m.SegmentUp(segment_id="s2", incarnation=1, capacity_bytes=100), 0)
    sh.apply(m.GroupsPublished(groups=[published(0)]), 1)
    moved = m.GroupPublished(
        group=chain(0), chunk_index=0, members=1, namespace=NAMESPACE, placements=[m.SegmentBytes("s2", 20)]
    )
    sh.apply(m.GroupsPublished(groups=[moved, published(1)]), 2)
    assert sh.core.used_bytes("s1") == 20 and sh.core.used_bytes("s2") == 20
    assert sh._held[A + chain(0)][2] == {"s2": 20}


def test_a_groups_unpinned_event_lets_a_victim_refused_as_pinned_go_at_once() -> None:
    """The directory's `GroupsUnpinned` reaches the core for the group it names (domain and
    chain hash): a victim backing off after pinned refusals is asked again on the next tick."""
    sh = shell()
    sh.apply(m.GroupsPublished(groups=[published(0), published(1), published(2)]), 1)
    (batch,) = sh.core.tick(2)
    assert isinstance(batch, EvictBatch) and batch.victims[0] == A + chain(2)
    for victim in batch.victims:
        sh.core.refused(victim, 2, pinned=True)
    assert sh.core.tick(3) == []  # cooling down 5 s
    other = DomainDigest(b"B" * 16)
    sh.apply(m.GroupsUnpinned(groups=[m.GroupRef(chain(2), other)]), 4)  # another domain's group
    assert sh.core.tick(4) == []
    sh.apply(m.GroupsUnpinned(groups=[m.GroupRef(chain(2), A)]), 5)
    latest = sh._decisions.of(A + chain(2))[-1]
    assert (latest.what, latest.reason) == ("unpinned", "its_last_pin_ended")
    (again,) = sh.core.tick(5)
    assert isinstance(again, EvictBatch) and again.victims[0] == A + chain(2)
    sh.core.check_invariants()

"""The router's index and one `published` event per commit (issue 20): a `GroupsPublished` is
one stream sequence; its groups are applied in order as `GroupPublished` events each are."""

from __future__ import annotations

from kvfabric.core.routing_index import ListedSegment, RoutingIndex
from kvfabric.format.ids import ChainHash, DomainDigest, Namespace, pack_group_key
from kvfabric.proto import directory as m

DOMAIN = DomainDigest(b"\x01" * 16)
CHAINS = [ChainHash(bytes([i]) * 32) for i in range(1, 5)]


def published(i: int, segment: str = "s0") -> m.GroupPublished:
    return m.GroupPublished(
        group=CHAINS[i],
        chunk_index=i,
        members=1,
        namespace=Namespace(b"\x00" * 4 + DOMAIN + b"\x00" * 34),
        placements=[m.SegmentBytes(segment, 100 + i)],
    )


def keys(n: int) -> list[bytes]:
    return [pack_group_key(DOMAIN, c) for c in CHAINS[:n]]


def fresh() -> RoutingIndex:
    index = RoutingIndex()
    index.resync([ListedSegment("s0", 1, True), ListedSegment("s1", 1, True)], [], at_seq=0)
    return index


def test_a_commits_event_makes_every_group_available_under_one_sequence() -> None:
    index = fresh()
    assert index.apply(1, m.GroupsPublished(groups=[published(i) for i in range(3)])) == "applied"
    assert index.last_seq == 1
    run = index.available_run(keys(3), 0)
    assert [(e.chunk_index, e.copy_bytes) for e in run] == [(0, 100), (1, 101), (2, 102)]
    assert index.apply(2, published(3)) == "applied"  # a single one (a republish, an old directory)
    assert len(index.available_run(keys(4), 0)) == 4


def test_a_redelivered_commit_event_changes_nothing() -> None:
    index = fresh()
    batch = m.GroupsPublished(groups=[published(0), published(1)])
    assert index.apply(1, batch) == "applied"
    assert index.apply(2, m.GroupEvicted(group=CHAINS[0], reason="pressure", domain=DOMAIN)) == "applied"
    assert index.apply(1, batch) == "duplicate"  # the evicted group stays gone
    assert [e.chunk_index for e in index.available_run(keys(2), 1)] == [1]
    assert index.available_run(keys(1), 0) == []


def test_a_lost_commit_event_is_one_gap_and_nothing_after_it_applies() -> None:
    index = fresh()
    assert index.apply(1, m.GroupsPublished(groups=[published(0)])) == "applied"
    # seq 2 (a commit of groups 1 and 2) is lost: seq 3 is a gap, and the index stops counting
    assert index.apply(3, m.GroupsPublished(groups=[published(3)])) == "gap"
    assert not index.synced and index.last_seq == 1
    assert index.available_run(keys(1), 0) == []  # not synced: no promise at all


def test_a_later_publish_in_the_same_event_wins() -> None:
    """The groups apply in order: the same group twice in one event ends as the last says."""
    index = fresh()
    assert index.apply(1, m.GroupsPublished(groups=[published(0, "s0"), published(0, "s1")])) == "applied"
    assert index.groups[keys(1)[0]].replicas == {"s1"}

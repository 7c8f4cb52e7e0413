"""A policy whose directory event stream lost events it never applied (aged out, purged) adopts
the directory's listing: every published group it does not track, ranked before anything it saw
used, so a cluster older than the stream's retention is still evicted (no NATS here)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import msgspec

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore
from kvfabric.eviction_policy.group_records import group_id_of, published_of_summary
from kvfabric.eviction_policy.shell import EvictionShell, now_ms
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE
from tests.unit.eviction_policy.test_shell import NAMESPACE_A, A, chain, published


def summary(i: int, *replicas: tuple[str, int], size: int = 10, state: str = "published") -> m.GroupSummary:
    return m.GroupSummary(
        group=chain(i),
        namespace=NAMESPACE_A,
        chunk_index=0,
        state=cast(Any, state),
        members=1,
        expected_members=1,
        objects=[
            m.ObjectLocation(
                chunk_index=0,
                member=m.Member(0, 0, 0),
                size_bytes=size,
                checksum=b"",
                replicas=[
                    m.Replica(segment_id=sid, incarnation=1, slot=slot, slot_generation=1)
                    for sid, slot in replicas
                ],
            )
        ],
    )


def test_a_listed_group_reads_as_the_published_event_that_would_have_told_of_it() -> None:
    event = published_of_summary(summary(1, ("s1", 3), ("s2", SSD_SLOT_BASE + 3), ("s1", SSD_SLOT_BASE)))
    assert event is not None
    assert event.placements == [m.SegmentBytes("s1", 20), m.SegmentBytes("s2", 10)]
    assert event.disk_placements == [m.SegmentBytes("s1", 10), m.SegmentBytes("s2", 10)]
    assert event.group_bytes == 10 and event.namespace == NAMESPACE_A and not event.parent
    assert published_of_summary(summary(2)) is None  # no live replica
    assert published_of_summary(summary(3, ("s1", 1), state="evicting")) is None


class Listing(DirectoryRouter):
    """One shard listing `groups` in pages of two."""

    def __init__(self, groups: list[m.GroupSummary]) -> None:
        super().__init__(cast(Any, None))
        self.groups = groups

    async def known_shards(self) -> int:
        return 1

    async def shard_pages(
        self, shard: int, query: m.ListGroups, timeout_s: float, pages_max: int
    ) -> AsyncIterator[m.GroupList]:
        assert query.with_objects and not query.domain_digest
        for at in range(0, len(self.groups), 2):
            yield m.GroupList(epoch=1, groups=self.groups[at : at + 2])


def test_untracked_groups_are_adopted_ranked_first_and_taken_again_from_their_own_event() -> None:
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.1))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
    t = now_ms()  # the adoption runs on the wall clock
    sh._started_ms = t - 900  # the policy started then; the events it replays come later
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), t - 800)
    sh.apply(published(1, s1=10), t - 800)  # the one group whose event is still in the stream
    listing = [summary(i, ("s1", i)) for i in (1, 2, 3, 4)] + [summary(5, ("s1", 5), state="evicting")]
    sh._router = Listing(listing)
    assert asyncio.run(sh.adopt_listed()) == 3  # 1 is tracked already, 5 is on its way out
    assert len(core) == 4 and core.used_bytes("s1") == 40 and sh.groups_adopted == 3
    adopted = sh.explain(group_id_of(NAMESPACE_A, 0, chain(2)))
    assert adopted.features["last_access_ms"] == t - 900 and adopted.decisions[0].reason == "listed"
    assert sh.status().counters["groups_adopted_total"] == 3
    # Adopted groups go before the one the policy saw published.
    sh.apply(published(6, s1=20), t + 10_000)  # 60 % > 50 %
    (batch,) = core.tick(t + 10_001)
    assert isinstance(batch, EvictBatch)
    assert set(batch.victims[:3]) == {A + chain(i) for i in (2, 3, 4)}
    for victim in batch.victims:
        core.refused(victim, t + 10_002)
    # Group 4's own event, read after the listing: it is taken again from it (parent, time).
    sh.apply(msgspec.structs.replace(published(4, parent=1, s1=10), chunk_index=1), t + 10_003)
    retaken = sh.explain(group_id_of(NAMESPACE_A, 1, chain(4)))
    assert retaken.features["last_access_ms"] == t + 10_003 and retaken.decisions[-1].reason == "always"
    assert sh._parent[A + chain(4)] == A + chain(1) and A + chain(4) not in sh._adopted
    sh.apply(published(3, s1=10), t + 10_004)  # the same for 3; a second event for it changes nothing more
    assert sh.explain(group_id_of(NAMESPACE_A, 0, chain(3))).features["last_access_ms"] == t + 10_004
    sh.apply(published(3, s1=10), t + 10_005)
    assert sh.explain(group_id_of(NAMESPACE_A, 0, chain(3))).features["last_access_ms"] == t + 10_004
    assert len(core) == 5
    core.check_invariants()

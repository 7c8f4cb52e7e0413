"""A policy whose directory event stream lost events it never applied (aged out, purged) adopts
the directory's listing: every published group it does not track, ranked before anything it saw
used, so a cluster older than the stream's retention is still evicted (no NATS here)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore
from kvfabric.eviction_policy.group_records import group_id_of, published_of_summary
from kvfabric.eviction_policy.shell import EvictionShell, now_ms
from kvfabric.format.errors import Unavailable
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.segment import SSD_SLOT_BASE
from tests.unit.eviction_policy.test_shell import NAMESPACE_A, A, chain, published


def summary(
    i: int, *replicas: tuple[str, int], size: int = 10, state: str = "published", incarnation: int = 1
) -> m.GroupSummary:
    """Group `i` listed with one object of `size` bytes, a replica per (segment, slot), each of
    that segment's `incarnation`."""
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
                    m.Replica(segment_id=sid, incarnation=incarnation, slot=slot, slot_generation=1)
                    for sid, slot in replicas
                ],
            )
        ],
    )


def segment_info(segment_id: str, *, up: bool, incarnation: int = 1) -> m.SegmentInfo:
    return m.SegmentInfo(
        segment_id=segment_id,
        incarnation=incarnation,
        domain=m.FailureDomain(host="h"),
        up=up,
        draining=False,
        capacity_bytes=1_000,
        reserved_bytes=0,
        reported_used_bytes=0,
        last_heartbeat_ms=0,
        data_addr="",
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
    """One shard listing `groups` in pages of two; its segment listing has the segments `up`
    up (by default every one a listed replica names) and those `down` down."""

    def __init__(
        self, groups: list[m.GroupSummary], up: Collection[str] | None = None, down: Collection[str] = ()
    ) -> None:
        super().__init__(cast(Any, None))
        self.groups = groups
        named = {r.segment_id for g in groups for o in g.objects for r in o.replicas}
        self.up = set(named if up is None else up)
        self.down = set(down)

    async def known_shards(self) -> int:
        return 1

    async def segments(self, timeout_s: float) -> m.SegmentList:
        return m.SegmentList(
            epoch=0,
            segments=[segment_info(s, up=s in self.up) for s in sorted(self.up | self.down)],
        )

    async def shard_pages(
        self, shard: int, query: m.ListGroups, timeout_s: float, pages_max: int
    ) -> AsyncIterator[m.GroupList]:
        assert query.with_objects and not query.domain_digest
        for at in range(0, len(self.groups), 2):
            yield m.GroupList(epoch=1, groups=self.groups[at : at + 2])


def lru_shell(**kwargs: Any) -> EvictionShell:
    """A shell around a fresh `lru` core (no NATS)."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.1))
    return EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, **kwargs)


async def run_adopter_until_one_adoption(sh: EvictionShell, meanwhile: Any = None) -> None:
    """Run the adopter task (and the coroutine `meanwhile`, if given) until it has adopted once
    (at most about a second), then cancel it."""
    task = asyncio.create_task(sh._adopter())
    if meanwhile is not None:
        await meanwhile
    for _ in range(200):
        if sh.adoptions:
            break
        await asyncio.sleep(0.005)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_untracked_groups_are_adopted_ranked_first_and_taken_again_from_their_own_event() -> None:
    sh = lru_shell(demote=False)
    core = sh.core
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


def test_an_adopted_head_taken_again_from_its_event_keeps_the_links_it_had_before_its_loss() -> None:
    """Head 1 on s1's disk, its disk-only tail 2 on s2's; s1 is lost, comes back, and the policy
    (its stream having lost events meanwhile) adopts 1 from the listing; then the follower reads
    the directory's republish of 1 (no parent, as adopted from a disk tier). The re-take must
    not forget 1's links (a review found it did): its tail still goes before it."""
    sh = lru_shell()
    t = now_ms()
    sh._started_ms = t - 900
    for segment in ("s1", "s2"):
        sh.apply(m.SegmentUp(segment_id=segment, incarnation=1, capacity_bytes=1_000), t - 800)
    head, tail = A + chain(1), A + chain(2)
    sh.apply(
        msgspec.structs.replace(published(1, s1=10), disk_placements=[m.SegmentBytes("s1", 10)]), t - 800
    )
    sh.apply(
        msgspec.structs.replace(published(2, parent=1, s2=10), disk_placements=[m.SegmentBytes("s2", 10)]),
        t - 800,
    )
    sh.apply(m.SegmentDown(segment_id="s1", incarnation=1, reason="heartbeat_timeout"), t - 700)
    sh.apply(m.GroupInvalidated(group=chain(1), reason="replica_lost", domain=A), t - 700)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=2, capacity_bytes=1_000), t - 600)
    # (s1's disk tier reported under its new incarnation: docs/segment.md, "Disk tier")
    sh._router = Listing(
        [summary(1, ("s1", SSD_SLOT_BASE), incarnation=2), summary(2, ("s2", SSD_SLOT_BASE))]
    )
    assert asyncio.run(sh.adopt_listed()) == 1 and head in sh._adopted
    assert sh._with_disk_tails([head]) == [tail, head]
    later = t + 10_000  # (after the adoption's own clock readings)
    sh.apply(msgspec.structs.replace(published(1, s1=10), disk_placements=[m.SegmentBytes("s1", 10)]), later)
    assert head in sh.core and head not in sh._adopted
    assert sh.explain(group_id_of(NAMESPACE_A, 0, chain(1))).features["last_access_ms"] == later
    assert sh._with_disk_tails([head]) == [tail, head]
    assert sh._parent == {tail: head} and sh._children == {head: {tail}}
    sh.core.check_invariants()


class StaleListing(Listing):
    """A listing whose second page was read before events the follower applies while it is on
    its way: group 2 evicted, segment s2 down (each page is older than what came since)."""

    def __init__(self, groups: list[m.GroupSummary], shell: EvictionShell) -> None:
        super().__init__(groups)
        self.shell = shell

    async def shard_pages(
        self, shard: int, query: m.ListGroups, timeout_s: float, pages_max: int
    ) -> AsyncIterator[m.GroupList]:
        first = True
        async for page in super().shard_pages(shard, query, timeout_s, pages_max):
            if not first:  # (on the adoption's clock: the core's time never goes back)
                at = self.shell._driver.now_ms()
                self.shell.apply(m.GroupEvicted(group=chain(3), reason="policy", domain=A), at)
                self.shell.apply(m.SegmentDown(segment_id="s2", incarnation=1, reason="drained"), at)
            first = False
            yield page


def test_a_listing_page_older_than_the_events_applied_since_adds_no_phantom() -> None:
    """Group 3 evicted and segment s2 gone while the listing was on its way: the page naming
    them must not put 3 back, nor count 4's bytes on s2 (a review found both did: phantoms that
    press a pool until the directory answers not_found)."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.1))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
    t = now_ms()
    sh._started_ms = t - 900
    for segment in ("s1", "s2"):
        sh.apply(m.SegmentUp(segment_id=segment, incarnation=1, capacity_bytes=1_000), t - 800)
    listing = [
        summary(1, ("s1", 1)),
        summary(2, ("s1", 2)),
        summary(3, ("s1", 3)),
        summary(4, ("s1", 4), ("s2", 4)),
    ]
    listing.append(summary(5, ("s2", 5)))
    sh._router = StaleListing(listing, sh)
    assert asyncio.run(sh.adopt_listed()) == 3  # 1, 2, and 4 on s1 only
    assert A + chain(3) not in core and A + chain(5) not in core
    assert core.used_bytes("s1") == 30 and core.used_bytes("s2") == 0
    assert sh._held[A + chain(4)][2] == {"s1": 10}
    assert sh._gone_while_adopting is None and sh._down_while_adopting is None
    core.check_invariants()


def test_the_stream_is_found_short_once_and_the_follower_goes_on_from_its_first_event() -> None:
    sh = lru_shell()
    assert sh._adopt_wanted.is_set()  # at every start, once the stream is replayed
    sh._adopt_wanted.clear()
    assert not sh.check_stream(0, 0, "t0")  # a new, empty stream
    assert not sh.check_stream(1, 40, "t0") and sh.last_seq == 0  # all there: read from the start
    assert not sh._adopt_wanted.is_set()
    assert sh.check_stream(101, 100, "t0")  # purged while nothing was applied: 1..100 are lost
    assert sh.last_seq == 100 and sh._adopt_after_seq == 100 and sh._adopt_wanted.is_set()
    sh._adopt_wanted.clear()
    assert not sh.check_stream(101, 100, "t0")  # a reconnect to the same empty stream: nothing more lost
    sh.last_seq = 150
    assert not sh.check_stream(120, 170, "t0")  # aged out, but only events applied already
    assert not sh.check_stream(151, 150, "t1")  # the directory's repair: recreated at our end + 1
    assert not sh._adopt_wanted.is_set()
    assert sh.check_stream(1, 170, "t2") and sh.last_seq == 0  # recreated from 1, already past us
    assert sh._adopt_after_seq == 170 and sh._adopt_wanted.is_set()
    sh._adopt_wanted.clear()
    sh.last_seq = 150
    assert sh.check_stream(0, 0, "t2") and sh.last_seq == 0  # recreated: its end below ours
    assert sh.check_stream(1, 30, "t2") is False and sh._adopt_wanted.is_set()


def event_msg(seq: int) -> SimpleNamespace:
    """A JetStream message of the directory's events as the follower reads it."""
    meta = SimpleNamespace(sequence=SimpleNamespace(stream=seq))
    return SimpleNamespace(data=encode(m.GroupsAccessed(groups=[])), metadata=meta)


def test_a_gap_in_the_sequences_read_is_events_lost_while_subscribed() -> None:
    sh = lru_shell()
    sh._adopt_wanted.clear()
    for seq in (1, 2, 3):
        sh._on_message(cast(Any, event_msg(seq)))
    assert not sh._adopt_wanted.is_set()
    sh._on_message(cast(Any, event_msg(9)))  # 4..8 aged out ahead of a lagging follower
    assert sh._adopt_wanted.is_set() and sh._adopt_after_seq == 9 and sh.last_seq == 9


def test_adoption_waits_for_the_follower_while_it_makes_progress_and_not_past_a_stall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvfabric.eviction_policy.shell as shell_module

    monkeypatch.setattr(shell_module, "ADOPT_FOLLOWER_STALL_S", 0.3)
    sh = lru_shell()

    async def follower(steps: int) -> None:
        for _ in range(steps):  # slower in all than one stall, never stalled that long
            await asyncio.sleep(0.03)
            sh._on_message(cast(Any, event_msg(sh.last_seq + 1)))

    async def scenario() -> tuple[bool, int, bool, int]:
        task = asyncio.create_task(follower(20))  # 0.6 s in all
        reached = await sh._reach(20)
        at = sh.last_seq
        await task
        stalled = await sh._reach(30)  # nothing more comes
        return reached, at, stalled, sh.last_seq

    assert asyncio.run(scenario()) == (True, 20, False, 20)


def test_a_wait_for_the_follower_ends_when_the_stream_is_recreated_under_it() -> None:
    sh = lru_shell()
    sh.last_seq = 500

    async def scenario() -> tuple[bool, float]:
        start = asyncio.get_running_loop().time()
        waiter = asyncio.create_task(sh._reach(1_000))
        await asyncio.sleep(0.05)
        sh.check_stream(1, 40, "new")  # sequences from 1 again: 1 000 names another event now
        for seq in range(1, 41):  # the new stream keeps the follower busy
            sh._on_message(cast(Any, event_msg(seq)))
        return await asyncio.wait_for(waiter, 5.0), asyncio.get_running_loop().time() - start

    reached, took = asyncio.run(scenario())
    assert reached is False and took < 1.0


def test_the_adopter_lists_only_once_the_follower_applied_what_the_stream_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sh = lru_shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1_000), now_ms() - 10)
    listed_at: list[int] = []

    class Recording(Listing):
        async def known_shards(self) -> int:
            listed_at.append(sh.last_seq)
            return 1

    sh._router = Recording([summary(1, ("s1", 1))])
    sh.caught_up.set()
    sh.check_stream(101, 105, "t0")  # 1..100 lost; 101..105 still to read

    async def follower() -> None:
        for seq in range(101, 106):
            await asyncio.sleep(0.02)
            assert not listed_at, "listed before the follower applied the stream"
            sh._on_message(cast(Any, event_msg(seq)))

    asyncio.run(run_adopter_until_one_adoption(sh, follower()))
    assert listed_at == [105] and sh.groups_adopted == 1


def test_an_adopted_group_forgotten_leaves_the_adopted_set() -> None:
    sh = lru_shell()
    t = now_ms()
    sh._started_ms = t - 900
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1_000), t - 800)
    sh._router = Listing([summary(1, ("s1", 1)), summary(2, ("s1", 2))])
    assert asyncio.run(sh.adopt_listed()) == 2 and sh._adopted == {A + chain(1), A + chain(2)}
    sh.apply(m.GroupEvicted(group=chain(1), reason="policy", domain=A), t + 10_000)
    assert sh._adopted == {A + chain(2)}


def test_the_adopter_retries_a_listing_that_fails_in_any_way(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvfabric.eviction_policy.shell as shell_module

    monkeypatch.setattr(shell_module, "ADOPT_RETRY_S", 0.0)
    sh = lru_shell()
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1_000), now_ms() - 10)
    failures = [Unavailable("directory away"), ValueError("a bug somewhere")]

    class Flaky(Listing):
        async def known_shards(self) -> int:
            if failures:
                raise failures.pop(0)
            return 1

    sh._router = Flaky([summary(1, ("s1", 1))])

    sh.caught_up.set()
    asyncio.run(run_adopter_until_one_adoption(sh))
    assert sh.adoptions == 1 and sh.groups_adopted == 1 and not failures

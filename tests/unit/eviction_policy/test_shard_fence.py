"""The eviction policy drops the late events of a directory shard core that a newer epoch replaced:
a handover drains the old core's queued events while its lease key is released (and nats-py may
flush a cancelled publish on reconnect), so one can land after the new core's `shard_started`, past
the adoption that marker asked for; applied, the policy tracked a group the directory no longer has
(its bytes counted on the segment, a victim the directory answers `not_found`) or forgot one it
has. Every event names its core in the `Kvf-Shard-Epoch` header; one naming an epoch below the
highest seen for its shard is dropped on the follower's path (`_read_events`), counted
`events_fenced` (`kvfabric_eviction_events_fenced_total`); one without the header (an older
directory) is applied as before (no NATS here)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from kvfabric.core.eviction import EvictionConfig, EvictionCore
from kvfabric.eviction_policy.metrics import EvictionCollector
from kvfabric.eviction_policy.shell import EvictionShell, now_ms
from kvfabric.format.ids import ChainHash, DomainDigest, Namespace
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.testing.logs import RecordingLog
from tests.unit.eviction_policy.test_adoption import Listing, run_adopter_until_one_adoption, summary

NAMESPACE = Namespace(bytes(4) + b"A" * 16 + bytes(34))
WAIT_S = 20.0  # generous: a loaded machine


def published(i: int, size: int) -> m.GroupsPublished:
    group = m.GroupPublished(
        group=ChainHash(i.to_bytes(32, "little")),
        chunk_index=0,
        members=1,
        namespace=NAMESPACE,
        placements=[m.SegmentBytes("s1", size)],
        group_bytes=size,
    )
    return m.GroupsPublished(groups=[group])


def message(seq: int, event: msgspec.Struct, origin: tuple[int, int] | None) -> Any:
    """A JetStream message of the directory's events as nats-py delivers it."""
    headers = m.shard_epoch_header(*origin) if origin is not None else None
    return SimpleNamespace(
        data=encode(event), metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq)), headers=headers
    )


class Sub:
    """A pull subscription holding `batch`: one fetch takes it all, the next ones find nothing."""

    def __init__(self, batch: list[Any]) -> None:
        self.batch = batch
        self.fetches = 0

    async def fetch(self, batch: int = 1, timeout: float | None = 5) -> list[Any]:  # noqa: ASYNC109
        self.fetches += 1
        if self.fetches == 1:
            return self.batch
        await asyncio.sleep(0.01)
        raise TimeoutError


def test_a_late_event_of_a_replaced_core_is_dropped_and_counted() -> None:
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.5), {})
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1 << 20), 0)
    sh._adopt_wanted.clear()  # (set at every start: the first replay adopts anyway)
    batch = [
        message(1, m.ShardStarted(shard=0, epoch=5), (0, 5)),  # the new core of shard 0
        message(2, published(0, 1), (0, 4)),  # the old core's late publication
        message(3, published(1, 10), (0, 5)),  # the new core's
        message(4, published(2, 100), None),  # an older directory's: no header
        message(5, published(3, 1_000), (1, 4)),  # another shard has its own epochs
    ]

    async def run(batch: list[Any]) -> None:
        sub = Sub(batch)
        follower = asyncio.create_task(sh._read_events(sub, end_seq=0))
        while sub.fetches < 2:  # noqa: ASYNC110 (the fake changes plain state)
            await asyncio.sleep(0.01)
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower

    asyncio.run(asyncio.wait_for(run(batch), WAIT_S))
    assert sh.last_seq == 5  # in sequence: the fenced event counts as applied
    assert len(core) == 3 and core.used_bytes("s1") == 1_110  # not the late group's byte
    assert sh.events_fenced == 1
    assert sh._adopt_wanted.is_set() and sh._adopt_after_seq == 1  # the marker's adoption

    # A stale marker (the replaced core's own, late) is dropped too: no adoption on it.
    sh._adopt_wanted.clear()
    asyncio.run(asyncio.wait_for(run([message(6, m.ShardStarted(shard=0, epoch=4), (0, 4))]), WAIT_S))
    assert sh.last_seq == 6 and sh.events_fenced == 2 and not sh._adopt_wanted.is_set()
    fenced = [
        s.value
        for family in EvictionCollector(sh).collect()
        for s in family.samples
        if s.name == "kvfabric_eviction_events_fenced_total"
    ]
    assert fenced == [2]


A = DomainDigest(b"A" * 16)  # NAMESPACE's share domain
G = A + ChainHash((1).to_bytes(32, "little"))  # the group `published(1, ...)` names


class Handed(Listing):
    """Shard 0 listed by its new leader, epoch 5, holding `groups` (by default group 1 on s1);
    `epochs`: the newest epoch the router knows per shard as the adoption begins
    (`DirectoryRouter.epochs`); `first`: run once, as the shard's first listing begins, before its
    first page comes (the follower reading on meanwhile)."""

    def __init__(
        self,
        epochs: dict[int, int],
        first: Callable[[], None] | None = None,
        groups: list[m.GroupSummary] | None = None,
    ) -> None:
        super().__init__([summary(1, ("s1", 1), size=10)] if groups is None else groups)
        self.epochs = dict(epochs)
        self.first = first

    async def shard_pages(
        self, shard: int, query: m.ListGroups, timeout_s: float, pages_max: int
    ) -> AsyncIterator[m.GroupList]:
        first, self.first = self.first, None
        if first is not None:
            first()
        yield m.GroupList(epoch=5, groups=self.groups)


def fresh_shell() -> EvictionShell:
    """A policy with segment s1 up whose start adoption is done (nothing asked for)."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.5), {})
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
    sh._started_ms = now_ms() - 900
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1 << 20), now_ms() - 800)
    sh._adopt_wanted.clear()
    sh._adopt_fences = False
    sh.caught_up.set()
    return sh


def tracking_g() -> EvictionShell:
    """A policy that applied group 1's publication by shard 0's core under epoch 4."""
    sh = fresh_shell()
    sh._on_message(message(1, published(1, 10), (0, 4)))
    assert G in sh.core and sh._shard_epochs.highest(0) == 4
    return sh


def late_eviction(seq: int, i: int = 1) -> Any:
    """The old core's (epoch 4) `evicted` of group `i` (by default 1, late: the new core holds
    the group)."""
    return message(
        seq, m.GroupEvicted(group=ChainHash(i.to_bytes(32, "little")), reason="policy", domain=A), (0, 4)
    )


def gap_after_1(sh: EvictionShell) -> None:
    """The stream lost events 2-10 ahead of the policy: it reads 11 next (shard 1's core's), a
    gap in the sequences, and asks for the adoption that makes up for it."""
    sh._on_message(message(11, published(7, 1), (1, 1)))
    assert sh.last_seq == 11 and sh._adopt_wanted.is_set() and sh._adopt_fences


def test_a_gap_adoption_fences_the_predecessors_of_the_leaders_it_listed() -> None:
    """The policy lagged; the stream dropped events 2-10, among them the `shard_started` of shard
    0's new core (epoch 5, which holds group 1). The adoption lists shard 0 under epoch 5; then
    the old core's late `evicted` of group 1 arrives: applied (the fence knew epoch 4 at most),
    the policy forgot a group the directory holds (its bytes counted nowhere, never evicted)."""
    sh = tracking_g()
    sh._router = Handed(epochs={})  # (the router knew no epoch before the listing's replies)
    gap_after_1(sh)
    asyncio.run(asyncio.wait_for(run_adopter_until_one_adoption(sh), WAIT_S))
    assert sh.adoptions == 1 and sh._shard_epochs.highest(0) == 5
    sh._on_message(late_eviction(12))
    assert sh.last_seq == 12 and sh.events_fenced == 1
    assert G in sh.core and sh.core.used_bytes("s1") == 11


def test_a_gap_adoption_fences_from_the_epochs_known_as_it_begins() -> None:
    """After a gap, the old core's late `evicted` arrives while the adoption is under way, before
    shard 0's first page: the epoch the router knew for the shard as the adoption began fences it
    (applied, the group was gone since the adoption began, and the page naming it was not
    taken)."""
    sh = tracking_g()
    sh._router = Handed(epochs={0: 5}, first=lambda: sh._on_message(late_eviction(12)))
    gap_after_1(sh)
    asyncio.run(asyncio.wait_for(run_adopter_until_one_adoption(sh), WAIT_S))
    assert sh.adoptions == 1
    assert sh.last_seq == 12 and sh.events_fenced == 1
    assert G in sh.core and sh.core.used_bytes("s1") == 11


@pytest.mark.parametrize("why", ["marker", "confirming"])
def test_a_marker_or_confirming_adoption_does_not_fence_the_valid_events_read_meanwhile(why: str) -> None:
    """Review, 2026-12-07: every adoption raised the fence to the epochs the router knew as it
    began, while the follower read on through its backlog. Shard 0's old core (epoch 4) publishes
    group 1 (seq 3) and evicts group 2 (seq 4) as the valid leader, before its successor's marker
    (seq 5, epoch 5); an adoption asked for another reason (another shard's marker at seq 2, or
    the one confirming missed groups gone) begins knowing epoch 5, and the follower reads 3-5
    before shard 0's page. Fenced, group 1 was adopted from the page ranked coldest instead of
    taken from its own `published`, and group 2 stayed counted until whole listings had missed
    it for `MISSED_FORGET_MS`."""
    sh = fresh_shell()
    sh._on_message(message(1, published(2, 100), (0, 4)))
    g2 = A + ChainHash((2).to_bytes(32, "little"))
    assert g2 in sh.core
    if why == "marker":
        sh._on_message(message(2, m.ShardStarted(shard=1, epoch=7), (1, 7)))
        assert sh._adopt_wanted.is_set() and not sh._adopt_fences
    else:
        sh._on_message(message(2, published(7, 1), (1, 1)))
        sh._confirm_due_ms = lambda: 0  # type: ignore[method-assign]  # (due: missed groups)
        assert not sh._adopt_wanted.is_set()

    def reads_on() -> None:
        sh._on_message(message(3, published(1, 10), (0, 4)))
        sh._on_message(late_eviction(4, i=2))
        sh._on_message(message(5, m.ShardStarted(shard=0, epoch=5), (0, 5)))

    sh._router = Handed(epochs={0: 5}, first=reads_on)
    asyncio.run(asyncio.wait_for(run_adopter_until_one_adoption(sh), WAIT_S))
    assert sh.adoptions >= 1 and sh.last_seq == 5 and sh.events_fenced == 0
    assert G in sh.core and G not in sh._adopted  # from its own event, not the page
    assert g2 not in sh.core and sh.core.used_bytes("s1") == (10 if why == "marker" else 11)
    assert sh._shard_epochs.highest(0) == 5  # the marker read raised it


def test_a_marker_read_before_the_gap_adoption_begins_keeps_it_fencing() -> None:
    """The `_adopt_fences` request is or-ed, not overwritten: after a gap, another shard's marker
    read before the adopter takes the request (one adoption answers both) must not turn the gap's
    fencing off; if it did, shard 0's new core (epoch 5, its `shard_started` among the lost
    events) did not fence its predecessor's late `evicted` of group 1."""
    sh = tracking_g()
    sh._router = Handed(epochs={})
    gap_after_1(sh)
    sh._on_message(message(12, m.ShardStarted(shard=1, epoch=9), (1, 9)))  # another shard's marker
    assert sh.last_seq == 12 and sh._adopt_wanted.is_set() and sh._adopt_fences
    asyncio.run(asyncio.wait_for(run_adopter_until_one_adoption(sh), WAIT_S))
    assert sh.adoptions == 1 and sh._shard_epochs.highest(0) == 5
    sh._on_message(late_eviction(13))
    assert sh.last_seq == 13 and sh.events_fenced == 1
    assert G in sh.core and sh.core.used_bytes("s1") == 11


@pytest.mark.parametrize("how", ["aged_out", "recreated"])
def test_check_stream_finding_events_lost_asks_for_a_fencing_adoption(how: str) -> None:
    """`check_stream`, as the follower (re)subscribes, finds events the policy never applied gone
    (aged out ahead of it, or the stream recreated): among them may be shard 0's new core's
    `shard_started` (epoch 5), so the adoption that makes up for them raises the fence, and the
    old core's late `evicted` of group 1 is dropped."""
    sh = tracking_g()
    sh._router = Handed(epochs={})
    if how == "aged_out":
        assert sh.check_stream(11, 11)  # events 2-10 aged out
    else:
        assert not sh.check_stream(1, 1, created="a")  # (the stream's creation time remembered)
        assert sh.check_stream(1, 1, created="b")  # recreated: its sequences restarted
    assert sh._adopt_wanted.is_set() and sh._adopt_fences
    end = sh.last_seq + 1
    sh._on_message(message(end, published(7, 1), (1, 1)))  # what the stream holds now
    asyncio.run(asyncio.wait_for(run_adopter_until_one_adoption(sh), WAIT_S))
    assert sh.adoptions == 1 and sh._shard_epochs.highest(0) == 5
    sh._on_message(late_eviction(end + 1))
    assert sh.last_seq == end + 1 and sh.events_fenced == 1
    assert G in sh.core and sh.core.used_bytes("s1") == 11


def test_the_start_adoption_fences() -> None:
    """A policy as constructed (no adoption state set by hand): its start adoption makes up for
    whatever the stream lost before it started, so it raises the fence to the epochs the router
    knows (shard 1's too, which it lists no page of here) and to the pages'; the replaced cores'
    late events read after it are dropped."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.5), {})
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1 << 20), now_ms() - 800)
    sh._router = Handed(epochs={0: 5, 1: 3})
    sh.caught_up.set()  # (the follower replayed the stream: empty)
    asyncio.run(asyncio.wait_for(run_adopter_until_one_adoption(sh), WAIT_S))
    assert sh.adoptions == 1 and G in sh.core
    assert sh._shard_epochs.highest(0) == 5 and sh._shard_epochs.highest(1) == 3
    sh._on_message(late_eviction(1))  # shard 0's old core's
    sh._on_message(message(2, published(7, 1), (1, 2)))  # shard 1's old core's
    assert sh.last_seq == 2 and sh.events_fenced == 2
    assert G in sh.core and len(sh.core) == 1 and sh.core.used_bytes("s1") == 10


def test_a_marker_adoption_after_a_gap_adoption_does_not_fence() -> None:
    """The request's fencing is taken (reset) by the adoption that answers it: after the gap's
    adoption, a later marker's adoption (another shard's) does not raise the fence. The router has
    meanwhile learned shard 0's epoch 6, whose marker the follower has yet to read: shard 0's
    epoch 5 core's events before it are valid and must be applied, not dropped."""
    sh = tracking_g()
    sh._router = router = Handed(epochs={})
    calls: list[bool] = []
    adopt_listed = sh.adopt_listed

    async def spy(*, fences: bool = False) -> int:
        calls.append(fences)
        return await adopt_listed(fences=fences)

    sh.adopt_listed = spy  # type: ignore[method-assign]
    gap_after_1(sh)
    asked: list[tuple[bool, bool]] = []  # (wanted, fences) as the marker asked for its adoption

    async def run() -> None:
        task = asyncio.create_task(sh._adopter())
        try:
            while sh.adoptions < 1:  # noqa: ASYNC110 (the adopter changes plain state)
                await asyncio.sleep(0.005)
            router.epochs[0] = 6
            sh._on_message(message(12, m.ShardStarted(shard=1, epoch=9), (1, 9)))
            asked.append((sh._adopt_wanted.is_set(), sh._adopt_fences))
            while sh.adoptions < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(run(), WAIT_S))
    assert asked == [(True, False)] and calls == [True, False] and sh._shard_epochs.highest(0) == 5
    sh._on_message(message(13, published(3, 100), (0, 5)))  # shard 0's epoch 5 core's, valid
    assert sh.last_seq == 13 and sh.events_fenced == 0
    assert sh.core.used_bytes("s1") == 111


def test_a_replaced_cores_late_events_are_logged_once_for_each_shard_and_epoch() -> None:
    """A drained outbox puts a thousand or two late events of one core in the stream: each one
    logged at info flooded the log. The first of each (shard, epoch) is logged, the rest
    counted."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.5), {})
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1 << 20), 0)
    logged = RecordingLog()
    sh._log = cast(Any, logged)
    origins = [(0, 5), *[(0, 4)] * 50, (1, 7), *[(1, 6)] * 20, *[(0, 3)] * 5, (0, 4), (1, 2)]
    for seq, origin in enumerate(origins, start=1):
        sh._on_message(message(seq, published(seq, 1), origin))
    assert sh.last_seq == len(origins) and sh.events_fenced == len(origins) - 2
    fenced = [fields["origin"] for _, event, fields in logged.lines if event == "event_fenced"]
    assert fenced == [(0, 4), (1, 6), (0, 3), (0, 4), (1, 2)]
    assert {level for level, event, _ in logged.lines if event == "event_fenced"} == {"info"}

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

from kvfabric.core.eviction import EvictionConfig, EvictionCore
from kvfabric.eviction_policy.metrics import EvictionCollector
from kvfabric.eviction_policy.shell import EvictionShell, now_ms
from kvfabric.format.ids import ChainHash, DomainDigest, Namespace
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from tests.unit.eviction_policy.test_adoption import Listing, summary

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
    """Shard 0 listed by its new leader, epoch 5 (its `shard_started` lost in the gap the
    adoption makes up for), holding group 1 on s1; `epochs`: the newest epoch the router knows
    per shard as the adoption begins (`DirectoryRouter.epochs`); `first`: run as the shard's
    listing begins, before its first page comes."""

    def __init__(self, epochs: dict[int, int], first: Callable[[], None] | None = None) -> None:
        super().__init__([summary(1, ("s1", 1), size=10)])
        self.epochs = dict(epochs)
        self.first = first

    async def shard_pages(
        self, shard: int, query: m.ListGroups, timeout_s: float, pages_max: int
    ) -> AsyncIterator[m.GroupList]:
        if self.first is not None:
            self.first()
        yield m.GroupList(epoch=5, groups=self.groups)


def tracking_g() -> EvictionShell:
    """A policy that applied group 1's publication by shard 0's core under epoch 4."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.5), {})
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
    sh._started_ms = now_ms() - 900
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1 << 20), now_ms() - 800)
    sh._on_message(message(1, published(1, 10), (0, 4)))
    assert G in core and sh._shard_epochs.highest(0) == 4
    return sh


def late_eviction(seq: int) -> Any:
    """The old core's (epoch 4) `evicted` of group 1, late: the new core holds the group."""
    return message(
        seq, m.GroupEvicted(group=ChainHash((1).to_bytes(32, "little")), reason="policy", domain=A), (0, 4)
    )


def test_a_gap_adoption_fences_the_predecessors_of_the_leaders_it_listed() -> None:
    """The policy lagged; the stream dropped events 2-10, among them the `shard_started` of shard
    0's new core (epoch 5, which holds group 1). The adoption lists shard 0 under epoch 5; then
    the old core's late `evicted` of group 1 arrives: applied (the fence knew epoch 4 at most),
    the policy forgot a group the directory holds (its bytes counted nowhere, never evicted)."""
    sh = tracking_g()
    sh._router = Handed(epochs={})  # (the router knew no epoch before the listing's replies)
    asyncio.run(asyncio.wait_for(sh.adopt_listed(), WAIT_S))
    assert sh._shard_epochs.highest(0) == 5
    sh._on_message(late_eviction(11))  # (after the gap: another adoption is asked, as before)
    assert sh.last_seq == 11 and sh.events_fenced == 1
    assert G in sh.core and sh.core.used_bytes("s1") == 10


def test_an_adoption_fences_from_the_epochs_known_as_it_begins() -> None:
    """The old core's late `evicted` arrives while the adoption is under way, before shard 0's
    first page: the epoch the router knew for the shard as the adoption began fences it (applied,
    the group was gone since the adoption began, and the page naming it was not taken)."""
    sh = tracking_g()
    sh._router = Handed(epochs={0: 5}, first=lambda: sh._on_message(late_eviction(11)))
    asyncio.run(asyncio.wait_for(sh.adopt_listed(), WAIT_S))
    assert sh.last_seq == 11 and sh.events_fenced == 1
    assert G in sh.core and sh.core.used_bytes("s1") == 10


class Logged:
    """A logger that keeps what it is asked to log: (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.lines.append((level, event, fields))


def test_a_replaced_cores_late_events_are_logged_once_for_each_shard_and_epoch() -> None:
    """A drained outbox puts a thousand or two late events of one core in the stream: each one
    logged at info flooded the log. The first of each (shard, epoch) is logged, the rest
    counted."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.9, low_watermark=0.5), {})
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1 << 20), 0)
    logged = Logged()
    sh._log = cast(Any, logged)
    origins = [(0, 5), *[(0, 4)] * 50, (1, 7), *[(1, 6)] * 20, *[(0, 3)] * 5, (0, 4), (1, 2)]
    for seq, origin in enumerate(origins, start=1):
        sh._on_message(message(seq, published(seq, 1), origin))
    assert sh.last_seq == len(origins) and sh.events_fenced == len(origins) - 2
    fenced = [fields["origin"] for _, event, fields in logged.lines if event == "event_fenced"]
    assert fenced == [(0, 4), (1, 6), (0, 3), (0, 4), (1, 2)]
    assert {level for level, event, _ in logged.lines if event == "event_fenced"} == {"info"}

"""The eviction-policy shell against a sharded directory (no NATS): a victim batch goes out as
one `evict` per shard holding some of its groups, in the batch's order, and a shard that does not
answer cools down its own victims and, since they may still be there, the heads above them (never
asked, so a tail the silent shard may still hold keeps them)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.core.eviction import EvictBatch, EvictionConfig, EvictionCore
from kvfabric.eviction_policy.shell import EvictionShell
from kvfabric.format.errors import Indeterminate
from kvfabric.proto import directory as m
from kvfabric.proto.shards import shard_of
from tests.unit.eviction_policy.test_shell import A, published

SHARDS = 3


class FakeRouter(DirectoryRouter):
    def __init__(self, failing: set[int]) -> None:
        super().__init__(cast(Any, None))
        self.shards = SHARDS
        self.failing = failing
        self.asked: list[tuple[int, str, msgspec.Struct]] = []

    async def refresh(self) -> None:
        raise AssertionError("the map is known")

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        self.asked.append((shard, verb, message))
        assert verb == "evict" and isinstance(message, m.Evict)
        assert all(shard_of(g, SHARDS) == shard for g in message.groups)
        if shard in self.failing:
            raise Indeterminate("no reply")
        return m.EvictReply(
            epoch=1, results=[m.EvictResult(group=g, status="evicting") for g in message.groups]
        )


def test_a_batch_is_split_by_shard_in_order_and_a_silent_shard_cools_down_its_own() -> None:
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.1))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=100), 0)
    sh.apply(published(1, s1=10), 1)
    for i in range(2, 9):  # one chain 1 <- 2 <- ... <- 8: chain(i) is on shard i % SHARDS
        sh.apply(published(i, parent=i - 1, s1=10), i)
    (batch,) = core.tick(20)
    assert isinstance(batch, EvictBatch)
    victims = [v for v in batch.victims if isinstance(v, bytes)]
    # One request per run of consecutive victims of one shard, in the batch's order (tails first).
    expected: list[tuple[int, list[bytes]]] = []
    for v in victims:
        shard = shard_of(v, SHARDS)
        if expected and expected[-1][0] == shard:
            expected[-1][1].append(sh._group_ids[v])
        else:
            expected.append((shard, [sh._group_ids[v]]))
    assert len({shard for shard, _ in expected}) >= 2
    silent = expected[1][0]  # the second run's shard (the first run's is another: runs alternate)
    group_id = dict(sh._group_ids)
    router = FakeRouter({silent})
    sh._router = router
    asyncio.run(sh._evict(batch))
    asked = [(s, message.groups) for s, _, message in router.asked if isinstance(message, m.Evict)]
    assert asked == expected[:2]  # the heads above an unanswered tail: not asked
    gone = set(expected[0][1])
    assert gone and len(victims) > len(gone) + len(expected[1][1])
    for v in victims:  # answered: gone; unanswered or above one: still there, cooled down
        assert (v in core) == (group_id[v] not in gone), v
        assert v not in core or not core.is_evicting(v)
    assert sh.evict_requests_failed == 1
    assert all(v[:16] == A for v in victims)
    core.check_invariants()


def test_unrelated_victims_go_in_one_request_per_shard_and_a_silent_shard_costs_one_timeout() -> None:
    """Runs of consecutive victims of one shard were one request per victim for unrelated
    leaves (batch order is rank order: shards at random), sent one after another: ~960 requests
    for 1,024 leaves over 16 shards, and a shard that timed out cost its timeout 73 times a
    batch (review, stop 68). Now one request per shard and tier a level."""
    core = EvictionCore(EvictionConfig(policy="lru", high_watermark=0.5, low_watermark=0.01))
    sh = EvictionShell(core, tick_ms=10, segments_refresh_ms=100, request_timeout_s=1.0, demote=False)
    sh.apply(m.SegmentUp(segment_id="s1", incarnation=1, capacity_bytes=1_000), 0)
    for i in range(1, 61):  # 60 unrelated prompts' first chunks
        sh.apply(published(i, s1=10), i)
    (batch,) = core.tick(100)
    assert isinstance(batch, EvictBatch)
    victims = [v for v in batch.victims if isinstance(v, bytes)]
    assert len(victims) >= 30
    shard_by = {v: shard_of(sh._group_ids[v], SHARDS) for v in victims}
    silent = shard_by[victims[0]]
    router = FakeRouter({silent})
    sh._router = router
    asyncio.run(sh._evict(batch))
    asked = [s for s, _, _ in router.asked]
    assert sorted(asked) == sorted(set(asked)) and len(asked) <= SHARDS  # one each
    for v in victims:  # the silent shard's victims stay (cooled down), the others are gone
        assert (v in core) == (shard_by[v] == silent), v
    assert sh.evict_requests_failed == 1
    core.check_invariants()

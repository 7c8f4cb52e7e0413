"""One prefix's lookup goes to each directory instance once (`kvfabric.cluster.lookups`, issue
20): the shards an instance leads travel in one `lookup_many`, a shard alone on its instance in
a plain `lookup`; a part refused for a routing reason is asked again alone (its shard's `ask`
refreshes the map), a part's other error is that shard's result, a stale part is never used, a
whole request that timed out fails its shards, and an instance without `lookup_many` (no
responders) is asked shard by shard from then on."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest

from kvfabric.cluster.directory_router import DirectoryRouter, ShardRoute
from kvfabric.cluster.lookups import ShardResult, lookup_by_instance
from kvfabric.directory.shard_requests import check_lookup_many
from kvfabric.format.errors import (
    BadRequest,
    BatchTooLarge,
    Indeterminate,
    RateLimited,
    StaleGeneration,
    Unavailable,
)
from kvfabric.format.ids import GroupId
from kvfabric.proto import directory as m

EPOCH = 5


def reply_for(shard: int, epoch: int = EPOCH) -> m.LookupReply:
    return m.LookupReply(epoch=epoch, hit_chunks=1, lease_id=100 + shard)


class Router(DirectoryRouter):
    """Shards 0-3 on instance a, 4 on b, 5-6 on c; asks recorded; `part_errors` (shard -> wire
    code) answered inside a `lookup_many`, `many_error` raised for a whole one."""

    def __init__(self) -> None:
        super().__init__(cast(Any, None))
        self.shards = 8
        self.routes = {s: ShardRoute("a" if s < 4 else "b" if s == 4 else "c", EPOCH) for s in range(7)}
        self.epochs = {s: EPOCH for s in range(7)}
        self.asked: list[int] = []
        self.many: list[tuple[str, list[int]]] = []
        self.part_errors: dict[int, str] = {}
        self.stale: set[int] = set()
        self.many_error: Exception | None = None

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        assert verb == "lookup" and isinstance(message, m.Lookup)
        self.asked.append(shard)
        return reply_for(shard)

    async def ask_instance(
        self, instance: str, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any
    ) -> Any:
        assert verb == "lookup_many" and isinstance(message, m.LookupMany)
        check_lookup_many(message)
        self.many.append((instance, [p.shard for p in message.parts]))
        if self.many_error is not None:
            raise self.many_error
        parts = []
        for part in message.parts:
            assert part.epoch == EPOCH and self.routes[part.shard].instance == instance
            if part.shard in self.part_errors:
                code = self.part_errors[part.shard]
                parts.append(m.LookupPartReply(shard=part.shard, error=code, message="x"))
            else:
                epoch = EPOCH - 1 if part.shard in self.stale else EPOCH
                parts.append(m.LookupPartReply(shard=part.shard, reply=reply_for(part.shard, epoch)))
        return m.LookupManyReply(parts=parts)


def lookups(shards: list[int]) -> dict[int, m.Lookup]:
    return {s: m.Lookup(holder_id="h", groups=[GroupId(bytes([s]) * 90)]) for s in shards}


def run(router: Router, shards: list[int], refused: set[str] | None = None) -> dict[int, ShardResult]:
    refused = set() if refused is None else refused
    ask = lookup_by_instance(router, lookups(shards), timeout_s=1.0, trace_id="t", refused=refused)
    return asyncio.run(ask)


def test_one_request_per_instance_and_a_plain_lookup_for_a_lone_shard() -> None:
    router = Router()
    results = run(router, [0, 1, 2, 4, 5, 6])
    assert sorted(router.many) == [("a", [0, 1, 2]), ("c", [5, 6])]
    assert router.asked == [4]
    assert results == {s: reply_for(s) for s in [0, 1, 2, 4, 5, 6]}


def test_a_part_refused_for_routing_is_asked_alone_and_other_errors_are_the_shards_result() -> None:
    router = Router()
    router.part_errors = {1: "wrong_shard", 2: "unavailable", 3: "rate_limited"}
    results = run(router, [0, 1, 2, 3])
    assert sorted(router.asked) == [1, 2]
    assert results[0] == reply_for(0) and results[1] == reply_for(1) and results[2] == reply_for(2)
    assert isinstance(results[3], RateLimited)


def test_a_part_from_an_older_epoch_is_never_used() -> None:
    router = Router()
    router.stale = {1}
    results = run(router, [0, 1])
    assert results[0] == reply_for(0) and isinstance(results[1], StaleGeneration)


def test_a_timed_out_request_fails_all_its_shards_without_asking_again() -> None:
    router = Router()
    router.many_error = Indeterminate("timeout")
    results = run(router, [0, 1, 4])
    assert isinstance(results[0], Indeterminate) and isinstance(results[1], Indeterminate)
    assert results[4] == reply_for(4) and router.asked == [4]


def test_an_instance_without_lookup_many_is_asked_shard_by_shard_from_then_on() -> None:
    router = Router()
    router.many_error = Unavailable("no responders on kvf.v1.directory.lookup_many.a")
    refused: set[str] = set()
    assert run(router, [0, 1], refused) == {0: reply_for(0), 1: reply_for(1)}
    assert refused == {"a"} and router.many == [("a", [0, 1])]
    router.asked.clear()
    assert run(router, [0, 1], refused) == {0: reply_for(0), 1: reply_for(1)}
    assert router.many == [("a", [0, 1])] and sorted(router.asked) == [0, 1]  # no second lookup_many


def test_lookup_many_bounds_are_checked_before_any_part_runs() -> None:
    part = m.LookupPart(shard=0, groups=[GroupId(bytes(90))])
    with pytest.raises(BadRequest, match="twice"):
        check_lookup_many(m.LookupMany(holder_id="h", parts=[part, part]))
    with pytest.raises(BadRequest, match="no group"):
        check_lookup_many(m.LookupMany(holder_id="h", parts=[m.LookupPart(shard=0, groups=[])]))
    too_many = [
        m.LookupPart(shard=s, groups=[GroupId(bytes(90))]) for s in range(m.LOOKUP_MANY_PARTS_MAX + 1)
    ]
    with pytest.raises(BatchTooLarge):
        check_lookup_many(m.LookupMany(holder_id="h", parts=too_many))
    half = m.LOOKUP_BATCH_GROUPS_MAX // 2 + 1
    heavy = [m.LookupPart(shard=s, groups=[GroupId(bytes(90))] * half) for s in range(2)]
    with pytest.raises(BatchTooLarge):
        check_lookup_many(m.LookupMany(holder_id="h", parts=heavy))

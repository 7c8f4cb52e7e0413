"""The one shard-merged lookup (`kvfabric.cluster.lookups`, issue 26) that the client and the
prefetch service share: the hit ends at the first chunk any shard misses, a failing shard misses
from its first chunk, the leases of shards with no chunk inside the hit are given back at once,
all of them when nothing hit (and the failure is raised)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.cluster.lookups import Lease, lookup_prefix, merge_lookups
from kvfabric.format.errors import BadRequest, KvfError, Unavailable
from kvfabric.format.ids import GroupId
from kvfabric.proto import directory as m
from kvfabric.proto.shards import shard_of
from tests.unit.core.dirkit import groups

SHARDS = 4
# Shard 0 holds chunks 0, 2, 4; shard 1 chunks 1, 3; shard 2 chunk 5.
POSITIONS = {0: [0, 2, 4], 1: [1, 3], 2: [5]}


def found(hit: int, lease_id: int, expires_ms: int = 9_000) -> m.LookupReply:
    return m.LookupReply(epoch=1, hit_chunks=hit, lease_id=lease_id, lease_expires_ms=expires_ms)


def test_the_hit_is_the_first_chunk_any_shard_misses_and_leases_beyond_it_are_unneeded() -> None:
    results = {0: found(3, 10, 8_000), 1: found(1, 11, 7_000), 2: found(1, 12)}
    hit, unneeded = merge_lookups(6, POSITIONS, results)
    assert hit.hit_chunks == 3  # shard 1 misses its second chunk, chunk 3
    assert hit.leases == [(0, 10), (1, 11)] and hit.expires_ms == 7_000 and hit.failure is None
    assert unneeded == [(2, 12)]  # shard 2's only chunk (5) lies beyond the hit


def test_a_failing_shard_misses_from_its_first_chunk_the_chunks_before_still_hit() -> None:
    down = Unavailable("failing over")
    hit, unneeded = merge_lookups(6, POSITIONS, {0: found(3, 10), 1: down, 2: found(1, 12)})
    assert hit.hit_chunks == 1 and hit.failure is down
    assert hit.leases == [(0, 10)] and unneeded == [(2, 12)]


def test_a_reply_that_is_no_lookup_reply_is_a_failure() -> None:
    odd = m.LeaseReply(epoch=1, lease_id=1, expires_ms=0)
    hit, _ = merge_lookups(6, POSITIONS, {0: odd, 1: found(2, 11), 2: found(1, 12)})
    assert hit.hit_chunks == 0 and type(hit.failure) is KvfError
    assert "unexpected lookup reply LeaseReply" in str(hit.failure)


class Router(DirectoryRouter):
    """A known map of `SHARDS` shards, no leader known (each shard asked alone)."""

    def __init__(self, down: int) -> None:
        super().__init__(cast(Any, None))
        self.shards = SHARDS
        self.down = down

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        assert verb == "lookup" and isinstance(message, m.Lookup)
        if shard == self.down:
            raise Unavailable("failing over")
        return found(len(message.groups), 100 + shard)


def run(router: Router, raws: list[GroupId]) -> tuple[Any, list[Lease]]:
    given: list[Lease] = []

    async def give_back(leases: list[Lease]) -> None:
        given.extend(leases)

    async def go() -> Any:
        return await lookup_prefix(
            router,
            raws,
            holder_id="h",
            members=[m.Member(0, 0, 0)],
            lease_ttl_ms=1_000,
            timeout_s=1.0,
            trace_id="",
            refused=set(),
            give_back=give_back,
        )

    try:
        return asyncio.run(go()), given
    except KvfError as exc:
        return exc, given


def test_when_nothing_hits_because_a_shard_failed_every_lease_goes_back_and_it_raises() -> None:
    raws = [g.group_id() for g in groups(8, seed=1)]
    shards = {shard_of(r, SHARDS) for r in raws}
    outcome, given = run(Router(down=shard_of(raws[0], SHARDS)), raws)
    assert isinstance(outcome, Unavailable)
    assert sorted(given) == sorted((s, 100 + s) for s in shards - {shard_of(raws[0], SHARDS)})


def test_a_partial_hit_keeps_the_leases_inside_it_and_gives_back_the_others() -> None:
    raws = next(
        rs
        for rs in ([g.group_id() for g in groups(8, seed=s)] for s in range(100))
        if shard_of(rs[0], SHARDS) != shard_of(rs[1], SHARDS) and len({shard_of(r, SHARDS) for r in rs}) >= 3
    )
    first, down = shard_of(raws[0], SHARDS), shard_of(raws[1], SHARDS)
    outcome, given = run(Router(down=down), raws)
    assert outcome.hit_chunks == 1 and isinstance(outcome.failure, Unavailable)
    assert outcome.leases == [(first, 100 + first)]
    others = {shard_of(r, SHARDS) for r in raws} - {first, down}
    assert sorted(given) == sorted((s, 100 + s) for s in others)


def test_a_group_that_is_no_chunk_group_id_is_a_bad_request() -> None:
    outcome, given = run(Router(down=-1), [GroupId(b"short")])
    assert isinstance(outcome, BadRequest) and "chunk group ids" in outcome.message and given == []

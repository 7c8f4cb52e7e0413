"""The one shard-merged lookup (`kvfabric.cluster.lookups`, issue 26) that the client and the
prefetch service share: the hit ends at the first chunk any shard misses, a failing shard misses
from its first chunk, the leases of shards with no chunk inside the hit are given back at once,
all of them when nothing hit (and the failure is raised)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec

from kvfabric.cluster.directory_router import DirectoryRouter, ShardRoute
from kvfabric.cluster.lookups import Lease, lookup_by_instance, lookup_prefix, merge_lookups
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


class ManyRouter(DirectoryRouter):
    """Shards 0 and 1 both led by `dir-a` (one `lookup_many`), each at `epoch`; `ask_instance`
    answers per `many` (an exception, or parts); `ask` (a shard alone) answers found, and moves
    the shard to `after_single` first when set (a refresh found another leader)."""

    def __init__(self, many: Any, after_single: str = "") -> None:
        super().__init__(cast(Any, None))
        self.shards = 2
        self.routes = {0: ShardRoute("dir-a", 3), 1: ShardRoute("dir-a", 3)}
        self.many = many
        self.after_single = after_single
        self.singles: list[int] = []

    async def ask_instance(self, instance: str, verb: str, message: msgspec.Struct, *a: Any, **k: Any) -> Any:
        if isinstance(self.many, Exception):
            raise self.many
        return self.many

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        self.singles.append(shard)
        if self.after_single:
            self.routes[shard] = ShardRoute(self.after_single, 4)
        return found(len(message.groups), 100 + shard)  # type: ignore[attr-defined]


def by_instance(router: ManyRouter, refused: set[str]) -> dict[int, Any]:
    one = m.Lookup(holder_id="h", groups=[GroupId(b"g" * 16)], members=[m.Member(0, 0, 0)])
    lookups = dict.fromkeys((0, 1), one)
    return asyncio.run(lookup_by_instance(router, lookups, timeout_s=1.0, trace_id="", refused=refused))


def test_an_instance_gone_during_a_failover_is_not_refused_batching_for_good() -> None:
    """`no responders` on `lookup_many`: the shards are asked alone. The instance is put in
    `refused` (shard by shard from then on) only if it still leads once they answered (a
    directory without the verb); one that was restarting or gone (the singles found another
    leader) is asked in batches again (review, 2026-12-05)."""
    refused: set[str] = set()
    gone = ManyRouter(Unavailable("no responders on kvf.v1.directory.lookup_many.dir-a"), "dir-b")
    assert all(isinstance(r, m.LookupReply) for r in by_instance(gone, refused).values())
    assert refused == set()
    older = ManyRouter(Unavailable("no responders on kvf.v1.directory.lookup_many.dir-a"))
    assert all(isinstance(r, m.LookupReply) for r in by_instance(older, refused).values())
    assert refused == {"dir-a"}


def test_a_part_refused_as_stale_is_asked_again_alone_with_the_map_forgotten() -> None:
    """A part carried the map's epoch and the leader's is newer (it won the shard back): the
    part was refused before it ran, the route is forgotten and the shard asked alone."""
    stale = m.LookupPartReply(
        shard=0, error="stale_generation", message="stale directory_epoch: saw 3, current is 5"
    )
    ok = m.LookupPartReply(shard=1, reply=found(1, 7))
    router = ManyRouter(m.LookupManyReply(parts=[stale, ok]))
    results = by_instance(router, set())
    assert router.singles == [0] and isinstance(results[0], m.LookupReply)
    assert results[1] == found(1, 7) and 0 not in router.routes


def test_a_part_refused_as_wrong_shard_is_asked_again_alone_with_the_route_forgotten() -> None:
    """The shard moved (a handover): the part answered `wrong_shard`. Its route was kept, so the
    single went to the same instance, was refused again, and only then refreshed after a retry
    wait (review, stop 68). Now the route is forgotten first."""
    moved = m.LookupPartReply(shard=0, error="wrong_shard", message="shard 0 is not led here")
    ok = m.LookupPartReply(shard=1, reply=found(1, 7))
    router = ManyRouter(m.LookupManyReply(parts=[moved, ok]))
    results = by_instance(router, set())
    assert router.singles == [0] and isinstance(results[0], m.LookupReply)
    assert 0 not in router.routes and router.routes[1].instance == "dir-a"

"""A client lookup over a sharded directory (docs/design.md 3.1, 3.6, 3.7): the prefix's chunks are
asked of every shard holding some, the hit folds to the first chunk any shard misses (never
skipping a gap), a shard that fails cuts the hit at its first chunk instead of failing the whole
lookup, and no lease outlives its use: leases of shards beyond the hit are given back at once,
the rest with the hit, all of them when nothing hit."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, cast

import msgspec

from kvfabric.client import AsyncKvClient, ClientSettings, Hit
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.format.errors import Unavailable
from kvfabric.proto import directory as m
from kvfabric.proto.shards import shard_of
from tests.integration.clientkit import SPEC, prompt

SHARDS = 4
CHUNKS = 8
Answer = Callable[[int, m.Lookup], m.LookupReply | Exception]


class FakeRouter(DirectoryRouter):
    """A known map of `SHARDS` shards; lookups answered by `answer`, releases recorded."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(cast(Any, None))
        self.shards = SHARDS
        self.answer = answer
        self.released: list[tuple[int, int]] = []

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        if isinstance(message, m.LeaseRelease):
            assert message.shard == shard
            self.released.append((shard, message.lease_id))
            return m.LeaseReply(epoch=1, lease_id=message.lease_id, expires_ms=0)
        assert isinstance(message, m.Lookup)
        assert {shard_of(g, SHARDS) for g in message.groups} == {shard}  # one shard per request
        reply = self.answer(shard, message)
        if isinstance(reply, Exception):
            raise reply
        return reply


def located(raw: bytes) -> m.ObjectLocation:
    replica = m.Replica(segment_id="s1", incarnation=1, slot=0, slot_generation=1)
    return m.ObjectLocation(
        chunk_index=int.from_bytes(raw[54:58], "little"),
        member=m.Member(0, 0, 0),
        size_bytes=10,
        checksum=b"c" * 16,
        replicas=[replica],
    )


def spread(tokens: list[int]) -> bool:
    """Chunks on at least 3 shards, chunks 0 and 1 on different ones."""
    shards = [shard_of(g.to_bytes(), SHARDS) for g in KV_IDS.chunk_groups(tokens)]
    return len(set(shards)) >= 3 and shards[0] != shards[1]


KV_IDS = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)  # computes ids only
TOKENS = next(
    t for t in (prompt(CHUNKS * SPEC.layout.tokens_per_chunk, seed=s) for s in range(100)) if spread(t)
)
RAWS = [g.to_bytes() for g in KV_IDS.chunk_groups(TOKENS)]


def stored_up_to(stored: int) -> Answer:
    """Every shard holds the prefix's chunks < `stored`; each grants lease `100 + shard`."""
    index = {raw: i for i, raw in enumerate(RAWS)}

    def answer(shard: int, message: m.Lookup) -> m.LookupReply:
        hits = next((n for n, raw in enumerate(message.groups) if index[raw] >= stored), len(message.groups))
        return m.LookupReply(
            epoch=1,
            hit_chunks=hits,
            lease_id=100 + shard if hits else 0,
            lease_expires_ms=5_000,
            objects=[located(raw) for raw in message.groups[:hits]],
        )

    return answer


def failing(shard_down: int, otherwise: Answer) -> Answer:
    return lambda shard, message: (
        Unavailable("failing over") if shard == shard_down else otherwise(shard, message)
    )


def client_with(answer: Answer) -> tuple[AsyncKvClient, FakeRouter]:
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
    router = FakeRouter(answer)
    kv.router = router
    kv.nc = cast(Any, object())  # "connected": the fake router does every request
    return kv, router


def test_the_hit_is_the_first_chunk_any_shard_misses_and_unused_leases_go_back() -> None:
    kv, router = client_with(stored_up_to(5))
    hit = asyncio.run(kv.lookup(TOKENS))
    assert hit.chunks == 5 and hit.cause == ""
    inside = {shard_of(r, SHARDS) for r in RAWS[:5]}
    assert {s for s, _ in hit.shard_leases} == inside  # one lease per shard inside the hit
    assert set(kv._leases) == set(hit.shard_leases)
    asyncio.run(kv.release(hit))
    assert kv._leases == {} and sorted(router.released) == sorted(hit.shard_leases)


def settled_lookup(kv: AsyncKvClient) -> Hit:
    """`lookup`, then the give-backs it started in the background (unneeded shards' leases)."""

    async def run() -> Hit:
        hit = await kv.lookup(TOKENS)
        if kv._giving_back:
            await asyncio.wait(list(kv._giving_back), timeout=5)
        return hit

    return asyncio.run(run())


def test_a_failing_shard_cuts_the_hit_at_its_first_chunk() -> None:
    down = shard_of(RAWS[1], SHARDS)  # its first chunk is chunk 1 (chunk 0 lies elsewhere)
    kv, router = client_with(failing(down, stored_up_to(CHUNKS)))
    hit = settled_lookup(kv)
    assert hit.chunks == 1 and hit.cause == ""
    # Shards with no chunk inside the hit gave their leases back at once; the rest go with the hit.
    assert {s for s, _ in hit.shard_leases} == {shard_of(RAWS[0], SHARDS)}
    early = set(router.released)
    assert early and not early & set(hit.shard_leases)
    asyncio.run(kv.release(hit))
    assert kv._leases == {}


def test_when_nothing_hits_because_a_shard_failed_every_lease_goes_back() -> None:
    down = shard_of(RAWS[0], SHARDS)
    kv, router = client_with(failing(down, stored_up_to(CHUNKS)))
    hit = settled_lookup(kv)
    assert hit.chunks == 0 and hit.cause == "directory_unavailable" and hit.lease_id == 0
    assert kv._leases == {} and len(router.released) == len({shard_of(r, SHARDS) for r in RAWS}) - 1


def test_a_cancelled_lookup_gives_back_what_its_requests_are_granted_once_they_answer() -> None:
    """The engine gave up (the sync lookup's timeout, a cancelled `lookup_async`, `close`): the
    requests still out run to their deadline and every lease they are granted goes back (review,
    stop 65: the leases of shards that answered were thrown away with the gather and held until
    their TTL, 30 s)."""
    slow = shard_of(RAWS[1], SHARDS)
    answer = stored_up_to(8)

    class SlowRouter(FakeRouter):
        async def ask(
            self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any
        ) -> Any:
            if isinstance(message, m.Lookup) and shard == slow:
                await asyncio.sleep(0.2)  # its reply still on the way when the caller gives up
            return await super().ask(shard, verb, message, timeout_s, **kw)

    kv, _ = client_with(answer)
    router = SlowRouter(answer)
    kv.router = router

    async def run() -> None:
        lookup = asyncio.ensure_future(kv.lookup(TOKENS))
        await asyncio.sleep(0.05)
        lookup.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lookup
        assert router.released == []  # the slow shard has not answered yet
        async with asyncio.timeout(5):
            while len(router.released) < len({shard_of(r, SHARDS) for r in RAWS}):  # noqa: ASYNC110
                await asyncio.sleep(0.01)

    asyncio.run(run())
    assert sorted(router.released) == sorted((s, 100 + s) for s in {shard_of(r, SHARDS) for r in RAWS})
    assert kv._leases == {}


def test_a_lookup_ends_within_its_timeout_whatever_its_requests_do() -> None:
    """Each request had its own `lookup_timeout_ms`: a failover's refresh and retries, then
    singles after a late `lookup_many`, took 2-3 x it (review, stop 68). One deadline for the
    whole lookup now; the requests still out give back what they are granted."""
    answer = stored_up_to(8)

    class SlowRouter(FakeRouter):
        async def ask(
            self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any
        ) -> Any:
            if isinstance(message, m.Lookup):
                for _ in range(3):  # each try within its own timeout, three of them (retries)
                    await asyncio.sleep(0.9 * timeout_s)
            return await super().ask(shard, verb, message, timeout_s, **kw)

    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1", lookup_timeout_ms=400), SPEC)
    router = SlowRouter(answer)
    kv.router = router
    kv.nc = cast(Any, object())

    async def run() -> tuple[Hit, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        hit = await kv.lookup(TOKENS)
        took = loop.time() - started
        async with asyncio.timeout(5):
            while len(router.released) < len({shard_of(r, SHARDS) for r in RAWS}):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        return hit, took

    hit, took = asyncio.run(run())
    assert hit.chunks == 0 and hit.cause == "directory_timeout"
    assert took < 0.9  # 0.4 s and a scheduling margin; was 1.08 s and more
    assert kv._leases == {}


def test_a_shard_that_answers_past_the_lookups_budget_cuts_the_hit_at_its_first_chunk() -> None:
    """The shard of chunk 1 fails over (its router's refresh and retries take past the lookup's
    deadline): the whole lookup was a miss, the shards that had answered thrown away (review,
    stop 70). It misses from its own first chunk now, and gives back its lease when it answers."""
    answer = stored_up_to(8)
    slow = shard_of(RAWS[1], SHARDS)

    class OneSlowShard(FakeRouter):
        async def ask(
            self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **kw: Any
        ) -> Any:
            if isinstance(message, m.Lookup) and shard == slow:
                await asyncio.sleep(timeout_s)  # answers, but past the lookup's whole deadline
            return await super().ask(shard, verb, message, timeout_s, **kw)

    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1", lookup_timeout_ms=300), SPEC)
    router = OneSlowShard(answer)
    kv.router = router
    kv.nc = cast(Any, object())

    async def run() -> Hit:
        hit = await kv.lookup(TOKENS)
        async with asyncio.timeout(5):
            while (slow, 100 + slow) not in router.released:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        return hit

    hit = asyncio.run(run())
    assert hit.chunks == 1 and hit.cause == ""  # chunk 0, from another shard
    assert slow not in {s for s, _ in hit.shard_leases}


def test_a_save_without_a_shard_map_counts_its_chunks_failed() -> None:
    """With no directory answering the shard map every chunk of a save fails
    `directory_unavailable`: it counted in no save metric (review, stop 68)."""
    from tests.integration.clientkit import objects_for

    class NoMap(FakeRouter):
        async def known_shards(self) -> int:
            raise Unavailable("no directory answered the shard map")

    kv, _ = client_with(stored_up_to(0))
    kv.router = NoMap(stored_up_to(0))
    tokens = TOKENS[: 2 * SPEC.layout.tokens_per_chunk]
    result = asyncio.run(kv.save(tokens, objects_for(tokens, 0, 2)))
    assert result.chunks_failed == 2 and result.causes == {"directory_unavailable": 2}
    failed = kv.metrics.registry.get_sample_value(
        "kvfabric_client_save_failures_total", {"cause": "directory_unavailable"}
    )
    assert failed == 2

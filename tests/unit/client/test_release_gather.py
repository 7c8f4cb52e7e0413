"""Releases an engine does not wait for are gathered (issue 20, load path): `KvClient.release`
hands the hit to `AsyncKvClient.release_soon`, which gives leases back together, after at most
`RELEASE_GATHER_MS` or at once when `RELEASE_GATHER_LEASES_MAX` wait — one directory request for
many prompts instead of one per prompt — and never loses one: a gathered lease is still held
until it is sent, and `close` gives back every lease held and waits for the give-backs already
sent, so a client closing leaves none held."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvfabric.client import AsyncKvClient, ClientSettings, Hit, KvClient, aio_lookups
from kvfabric.client.aio_lookups import RELEASE_GATHER_LEASES_MAX, RELEASE_GATHER_MS
from kvfabric.client.sync import ENABLED, ClientStatus
from kvfabric.proto.common import TRACE_ID_HEADER
from tests.integration.clientkit import SPEC
from tests.unit.client.test_releases import ReleaseRouter

TPC = SPEC.layout.tokens_per_chunk


def hit_with(leases: list[tuple[int, int]]) -> Hit:
    return Hit(TPC, TPC, (), (SPEC.layout.member,), (), leases[0][1], 30_000, shard_leases=tuple(leases))


def holding(kv: AsyncKvClient, router: ReleaseRouter, leases: list[tuple[int, int]]) -> None:
    kv.router = router
    kv.nc = cast(Any, object())  # "connected": the router does every request
    for lease in leases:
        kv._leases[lease] = 30_000
    router.held |= set(leases)


def test_the_sync_release_of_many_prompts_is_one_request() -> None:
    """Ten prompts released back to back: one `lease_release` of their ten leases (one each before)."""
    kv = KvClient.disabled(SPEC, "test", "unit", settings=ClientSettings(nats_url="nats://unused:1"))
    router = ReleaseRouter()
    leases = [(0, 100 + i) for i in range(10)]
    holding(kv.aio, router, leases)
    kv.status = ClientStatus(ENABLED)
    try:
        for lease in leases:
            kv.release(hit_with([lease]))
        deadline = time.monotonic() + 5
        while router.held and time.monotonic() < deadline:
            time.sleep(0.005)
        assert router.held == set() and kv.aio._leases == {}
        assert len(router.requests) == 1 and sorted(router.requests[0].lease_ids) == [i for _, i in leases]
    finally:
        kv.close()


def test_a_full_batch_goes_at_once_and_a_lease_goes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio_lookups, "RELEASE_GATHER_MS", 600_000)  # only a full batch can go within the test

    async def run() -> ReleaseRouter:
        kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
        router = ReleaseRouter()
        leases = [(1, 1 + i) for i in range(RELEASE_GATHER_LEASES_MAX)]
        holding(kv, router, leases)
        kv.release_soon(hit_with(leases[:1]))
        kv.release_soon(hit_with(leases[:1]))  # twice: gathered once
        for lease in leases[1:]:
            kv.release_soon(hit_with([lease]))
        assert kv._giving_back and not kv._gathered  # sent at once, not held for the gather time
        await asyncio.wait(list(kv._giving_back), timeout=10)
        assert router.held == set()
        await kv.close()
        return router

    router = asyncio.run(run())
    assert [len(r.lease_ids) for r in router.requests] == [RELEASE_GATHER_LEASES_MAX]


def test_a_lone_release_still_goes_after_the_gather_time() -> None:
    async def run() -> ReleaseRouter:
        kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
        router = ReleaseRouter()
        holding(kv, router, [(2, 9)])
        traces: list[str] = []
        ask = router.ask

        async def traced(*args: Any, headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
            traces.append((headers or {}).get(TRACE_ID_HEADER, ""))
            return await ask(*args, **kwargs)

        router.ask = traced  # type: ignore[method-assign]
        kv.release_soon(dataclasses.replace(hit_with([(2, 9)]), trace_id="engine-req-7"))
        assert router.held == {(2, 9)}  # gathered, not sent yet: still held
        await asyncio.sleep(RELEASE_GATHER_MS / 1000 * 3)
        assert kv._leases == {}
        assert traces == ["engine-req-7"]  # the request carries the hit's trace id
        return router

    router = asyncio.run(run())
    assert router.held == set() and len(router.requests) == 1


def test_closing_with_gathered_and_sent_releases_leaves_none_held() -> None:
    """1,000 leases: a full batch sent (in flight when close starts), the rest gathered or never
    released; close gives back all of them and waits for the batch in flight."""

    async def run() -> tuple[ReleaseRouter, AsyncKvClient]:
        kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
        router = ReleaseRouter()
        leases = [(i % 3, 1 + i) for i in range(1_000)]
        holding(kv, router, leases)
        for lease in leases[: RELEASE_GATHER_LEASES_MAX + 10]:
            kv.release_soon(hit_with([lease]))
        assert kv._giving_back  # the first full batch is in flight
        await kv.close()
        kv.release_soon(hit_with(leases[-1:]))  # after close: nothing held, nothing sent
        return router, kv

    router, kv = asyncio.run(run())
    assert router.held == set() and kv._leases == {} and not kv._giving_back


def test_a_close_that_overruns_its_bound_goes_on_without_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    """`KvClient.close` waits for the async close within what its steps may take in all; past
    that it closes what is left and returns (it raised TimeoutError into the engine's shutdown;
    review, 2026-12-05). Saves asked after it are dropped, never raised."""
    from kvfabric.client import sync

    monkeypatch.setattr(sync, "_GRACE_S", 0.2)
    monkeypatch.setattr(sync, "_CLOSE_STEPS_S", 0.1)
    settings = ClientSettings(nats_url="nats://unused:1", save_timeout_ms=100, lookup_timeout_ms=100)
    kv = KvClient.disabled(SPEC, "test", "unit", settings=settings)
    kv.status = ClientStatus(ENABLED)

    async def hang() -> None:
        await asyncio.sleep(30)

    kv.aio.close = hang  # type: ignore[method-assign]
    started = time.monotonic()
    kv.close()
    assert time.monotonic() - started < 5
    assert kv.save_async([1] * 64, [[b"x"]]) is None


def lookup_answered_during_close(answer_after_s: float) -> tuple[Hit, set[tuple[int, int]], bool]:
    """A lookup out when `close` starts, its answer (lease (0, 5)) coming `answer_after_s`
    later, on a client whose NATS drain makes every later request fail as on a drained
    connection: its hit, the leases still held at the directory, whether close was still
    waiting when the answer came."""
    from kvfabric.format.errors import Unavailable
    from tests.unit.client.test_releases import client_holding

    class Drained(ReleaseRouter):
        drained = False

        async def ask(self, *args: Any, **kwargs: Any) -> Any:
            if self.drained:  # what a request on a drained connection does
                raise Unavailable("nats connection is closed")
            return await super().ask(*args, **kwargs)

    async def run() -> tuple[Hit, set[tuple[int, int]], bool]:
        router = Drained()
        kv = client_holding(router, [])

        class Nats:
            async def drain(self) -> None:
                router.drained = True

        kv.nc = cast(Any, Nats())
        router.held = {(0, 5)}  # what the directory granted the lookup still out
        back = asyncio.Event()

        async def slow_lookup(*args: Any) -> Any:
            await back.wait()
            return 1, [], [(0, 5)], 30_000

        kv._lookup_shards = slow_lookup  # type: ignore[method-assign,assignment]
        lookup = asyncio.ensure_future(kv.lookup(list(range(64))))
        await asyncio.sleep(0.01)
        closing = asyncio.ensure_future(kv.close())
        await asyncio.sleep(answer_after_s)
        waiting = not closing.done()
        back.set()
        hit = await lookup
        await closing
        return hit, router.held, waiting

    return asyncio.run(run())


def test_a_lookup_that_comes_back_after_close_began_gives_its_leases_back() -> None:
    """A lookup still out when `close` starts: its leases came after close gave back every lease
    held, and were kept until their TTL (review, 2026-12-05). Now it gives them back itself and
    is a miss (`closed`)."""
    hit, held, _ = lookup_answered_during_close(0.01)
    assert hit.tokens == 0 and hit.cause == "closed" and held == set()


def test_a_lookups_unneeded_shard_leases_go_back_without_delaying_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard whose chunks are past the hit: its lease was given back on the lookup's own path,
    so slow release answers made a lookup take 3-4 x `lookup_timeout_ms` (review, 2026-12-06)."""
    released: list[list[tuple[int, int]]] = []

    async def lookup_prefix(*args: Any, give_back: Any, **kwargs: Any) -> Any:
        await give_back([(1, 7)])  # the second shard's lease: none of its chunks are in the hit
        return SimpleNamespace(hit_chunks=0, objects=[], leases=[], expires_ms=0, failure=None)

    async def slow_release(leases: list[tuple[int, int]], trace_id: str = "") -> None:
        await asyncio.sleep(1.0)  # the directory answers late
        released.append(leases)
        for lease in leases:
            kv._leases.pop(lease, None)

    monkeypatch.setattr(aio_lookups, "lookup_prefix", lookup_prefix)
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
    kv.nc = cast(Any, object())
    kv.router = cast(Any, object())
    kv._release_leases = slow_release  # type: ignore[method-assign,assignment]

    async def run() -> float:
        started = time.monotonic()
        hit = await kv.lookup(list(range(4 * TPC)))
        took = time.monotonic() - started
        assert hit.tokens == 0 and kv._giving_back and kv._leases == {(1, 7): 0}
        await asyncio.wait(list(kv._giving_back), timeout=5)
        return took

    took = asyncio.run(run())
    assert took < 0.5 and released == [[(1, 7)]] and kv._leases == {}


def test_close_waits_for_a_lookup_in_flight_before_nats_drains() -> None:
    """A lookup still out when `close` starts, answered after close's own steps: it gave its
    leases back on a drained connection, which failed, so they were held until their TTL (review,
    stop 65). `close` now lets lookups in flight end (bounded by `lookup_timeout_ms`) first."""
    hit, held, waiting = lookup_answered_during_close(0.2)  # within lookup_timeout_ms
    assert waiting and hit.tokens == 0 and hit.cause == "closed" and held == set()

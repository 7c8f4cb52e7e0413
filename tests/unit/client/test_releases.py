"""Giving leases back (issue 20): a client closing with 1,000 leases sends them in batches of
at most `RELEASE_BATCH_LEASES_MAX` per shard, at most `RELEASES_CONCURRENT_MAX` requests in flight
(client-wide, below the tenant's share of the directory's give-back slots); `busy` is retried
with a growing, bounded backoff; a directory from before batches gets them one by one."""

from __future__ import annotations

import asyncio
import math
from typing import Any, cast

import msgspec
import pytest

from kvfabric.client import AsyncKvClient, ClientSettings
from kvfabric.client.releases import (
    RELEASE_ATTEMPTS_MAX,
    RELEASE_BUSY_WAIT_MS_MAX,
    RELEASE_BUSY_WAIT_MS_MIN,
    RELEASES_CONCURRENT_MAX,
    give_back,
    release_batches,
)
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.format.errors import Busy, Indeterminate, NotFound
from kvfabric.proto import directory as m
from tests.integration.clientkit import SPEC

SHARDS = 3
LEASES = 1_000


class ReleaseRouter(DirectoryRouter):
    """Answers `lease_release` like a directory (batches unless `old`), `busy` for the first
    `busy_first` attempts of each request; records requests and the most in flight at once."""

    def __init__(self, *, busy_first: int = 0, old: bool = False) -> None:
        super().__init__(cast(Any, None))
        self.shards = SHARDS
        self.busy_first = busy_first
        self.old = old
        self.held: set[tuple[int, int]] = set()
        self.requests: list[m.LeaseRelease] = []
        self.attempts: dict[tuple[int, ...], int] = {}
        self.inflight = self.inflight_max = 0

    async def ask(self, shard: int, verb: str, message: msgspec.Struct, timeout_s: float, **_: Any) -> Any:
        assert verb == "lease_release" and isinstance(message, m.LeaseRelease) and message.shard == shard
        self.inflight += 1
        self.inflight_max = max(self.inflight_max, self.inflight)
        try:
            await asyncio.sleep(0.001)  # a round trip: concurrent requests overlap
            ids = (message.lease_id, *message.lease_ids)
            self.attempts[ids] = self.attempts.get(ids, 0) + 1
            if self.attempts[ids] <= self.busy_first:
                raise Busy("tenant's share of the give-back in-flight limit reached")
            self.requests.append(message)
            if message.lease_ids and not self.old:
                released = [i for i in message.lease_ids if (shard, i) in self.held]
                self.held -= {(shard, i) for i in released}
                return m.LeaseReply(epoch=1, lease_id=0, expires_ms=0, released=released)
            if (shard, message.lease_id) not in self.held:  # an old directory sees lease 0 only
                raise NotFound(f"no lease {message.lease_id}")
            self.held.discard((shard, message.lease_id))
            return m.LeaseReply(epoch=1, lease_id=message.lease_id, expires_ms=0)
        finally:
            self.inflight -= 1


def client_holding(router: ReleaseRouter, leases: list[tuple[int, int]]) -> AsyncKvClient:
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
    kv.router = router
    kv.nc = cast(Any, object())  # "connected": the router does every request (close's drain fails quietly)
    for lease in leases:
        kv._leases[lease] = 30_000
    router.held = set(leases)
    return kv


LEASES_HELD = [(i % SHARDS, 1 + i) for i in range(LEASES)]


def test_close_gives_1000_leases_back_in_bounded_batches() -> None:
    router = ReleaseRouter()
    kv = client_holding(router, LEASES_HELD)
    asyncio.run(kv.close())
    assert router.held == set() and kv._leases == {}
    per_shard = [sum(1 for s, _ in LEASES_HELD if s == shard) for shard in range(SHARDS)]
    assert len(router.requests) == sum(math.ceil(n / m.RELEASE_BATCH_LEASES_MAX) for n in per_shard)
    assert all(len(r.lease_ids) <= m.RELEASE_BATCH_LEASES_MAX for r in router.requests)
    assert 1 < router.inflight_max <= RELEASES_CONCURRENT_MAX  # concurrent, below the tenant share


def test_the_bound_is_client_wide() -> None:
    """Many hits released at once plus the close: still at most RELEASES_CONCURRENT_MAX requests."""
    router = ReleaseRouter()
    kv = client_holding(router, LEASES_HELD[:200])

    async def run() -> None:
        await asyncio.gather(
            *(kv._release_leases([(shard, lease_id)]) for shard, lease_id in LEASES_HELD[:100]),
            kv._release_leases(LEASES_HELD[100:200]),
        )

    asyncio.run(run())
    assert router.held == set() and router.inflight_max <= RELEASES_CONCURRENT_MAX


def test_busy_is_retried_with_a_growing_bounded_backoff() -> None:
    router = ReleaseRouter(busy_first=RELEASE_ATTEMPTS_MAX - 1)
    router.held = set(LEASES_HELD[:130])
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    gate = asyncio.Semaphore(RELEASES_CONCURRENT_MAX)
    left = asyncio.run(
        give_back(_asker(router), "h", LEASES_HELD[:130], gate=gate, timeout_s=1.0, sleep=sleep)
    )
    assert left == 0 and router.held == set()  # the last allowed attempt went through
    requests = len(release_batches(LEASES_HELD[:130]))
    schedule_ms = [
        min(RELEASE_BUSY_WAIT_MS_MIN * 2**k, RELEASE_BUSY_WAIT_MS_MAX)
        for k in range(RELEASE_ATTEMPTS_MAX - 1)
    ]
    for base_ms in schedule_ms:  # every request waited each step of the schedule once (+0-50 %)
        assert sum(1 for w in waits if base_ms <= w * 1000 <= base_ms * 1.5) == requests
    assert len(waits) == requests * len(schedule_ms)
    assert sum(schedule_ms) * 1.5 < 1_000  # bounded: one request waits under a second in all


def test_busy_past_the_budget_gives_up_and_the_leases_are_left_to_expire() -> None:
    router = ReleaseRouter(busy_first=RELEASE_ATTEMPTS_MAX)
    router.held = set(LEASES_HELD[:10])
    gate = asyncio.Semaphore(RELEASES_CONCURRENT_MAX)

    async def sleep(_: float) -> None:
        return None

    left = asyncio.run(
        give_back(_asker(router), "h", LEASES_HELD[:10], gate=gate, timeout_s=1.0, sleep=sleep)
    )
    assert left == 10 and router.requests == []
    assert set(router.attempts.values()) == {RELEASE_ATTEMPTS_MAX}  # never more than the budget


def test_a_directory_from_before_batches_gets_them_one_by_one() -> None:
    router = ReleaseRouter(old=True)
    kv = client_holding(router, LEASES_HELD[:90])
    asyncio.run(kv.close())
    assert router.held == set()
    singles = [r for r in router.requests if not r.lease_ids]
    assert len(singles) == 90


def test_failures_other_than_busy_are_not_retried_and_never_raise() -> None:
    calls = 0

    async def ask(verb: str, message: m.DirectoryRequest, timeout_s: float, trace_id: str, shard: int) -> Any:
        nonlocal calls
        calls += 1
        raise Indeterminate("timed out")

    gate = asyncio.Semaphore(RELEASES_CONCURRENT_MAX)
    assert asyncio.run(give_back(ask, "h", LEASES_HELD[:3], gate=gate, timeout_s=1.0)) == 3
    assert calls == SHARDS  # one request per shard, once each


def _asker(router: ReleaseRouter) -> Any:
    async def ask(verb: str, message: m.DirectoryRequest, timeout_s: float, trace_id: str, shard: int) -> Any:
        return await router.ask(shard, verb, message, timeout_s)

    return ask


@pytest.mark.parametrize("n", [1, 64, 65, 200])
def test_batches_split_by_shard_and_size(n: int) -> None:
    leases = LEASES_HELD[:n]
    batches = release_batches(leases)
    assert sorted((s, i) for s, ids in batches for i in ids) == sorted(leases)
    assert all(1 <= len(ids) <= m.RELEASE_BATCH_LEASES_MAX for _, ids in batches)

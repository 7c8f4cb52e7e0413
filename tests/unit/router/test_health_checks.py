"""Engines' health checks do not wait for each other (review, stop 68): a round awaited every
engine's check, so one hung engine held every other engine's health answer for the connect
timeout; with a connect timeout past the stale window every engine went stale and every request
was refused. Now each engine has at most one check in flight, started every interval, and the
health loop's cancellation cancels the checks still waiting."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from prometheus_client import CollectorRegistry

from kvfabric.core.routing import RoutingCore
from kvfabric.core.routing_index import RoutingIndex
from kvfabric.format.clock import now_ms
from kvfabric.router.metrics import RouterMetrics
from kvfabric.router.proxy import Proxy
from kvfabric.router.settings import load_router_settings
from kvfabric.runtime.core_driver import CoreDriver
from tests.unit.router.test_settings_refit import ENV

HUNG = "http://127.0.0.1:1"
WELL = "http://127.0.0.1:2"


class _Answer:
    status_code = 200


class _HealthClient:
    """`GET /health`: the hung engine never answers, the other at once."""

    def __init__(self) -> None:
        self.asked: dict[str, int] = {HUNG: 0, WELL: 0}
        self.hung_cancelled = 0

    async def get(self, url: str) -> Any:
        base = url.removesuffix("/health")
        self.asked[base] += 1
        if base == HUNG:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.hung_cancelled += 1
                raise
        return _Answer()

    async def aclose(self) -> None:
        """Nothing to close (no connections)."""


def _proxy() -> Proxy:
    engines = [{"id": "hung", "url": HUNG}, {"id": "well", "url": WELL}]
    env = {
        **ENV,
        "KVF_ROUTER_ENGINES": json.dumps(engines),
        "KVF_ROUTER_HEALTH_INTERVAL_MS": "20",
        "KVF_ROUTER_CONNECT_TIMEOUT_MS": "5000",
        "KVF_ROUTER_HEALTH_STALE_MS": "6000",
    }
    settings = load_router_settings(env)
    core = RoutingCore(settings.routing, [e.spec for e in settings.engines], RoutingIndex())
    registry = CollectorRegistry()
    return Proxy(settings, core, RouterMetrics(registry), registry, CoreDriver(core, clock=lambda: now_ms()))


def test_a_hung_engine_does_not_hold_the_other_engines_checks() -> None:
    proxy = _proxy()
    fake = _HealthClient()
    proxy.health_client = fake  # type: ignore[assignment]

    async def run() -> None:
        loop = asyncio.create_task(proxy.health_loop())
        await asyncio.sleep(0.5)
        assert fake.asked[WELL] >= 5  # every interval (it was once, then held for 5 s)
        assert fake.asked[HUNG] == 1  # one check in flight per engine, not one per round
        assert proxy.core.eligible("well", now_ms()) and not proxy.core.eligible("hung", now_ms())
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        assert fake.hung_cancelled == 1 and proxy._checking == {}  # nothing outlives the loop

    asyncio.run(run())


def test_idle_engine_connections_are_dropped_before_the_engines_keep_alive_ends() -> None:
    """At httpx's default keep-alive (5 s, vLLM's too) a request could go out on a connection
    the engine was closing: `RemoteProtocolError` marked the engine down and forgot its cache
    (review, stop 70)."""
    from kvfabric.router.proxy import ENGINE_KEEPALIVE_S

    proxy = _proxy()
    for client in (proxy.client, proxy.health_client):
        pool = client._transport._pool  # type: ignore[attr-defined]
        assert pool._keepalive_expiry == ENGINE_KEEPALIVE_S < 5.0


def test_health_timings_that_let_a_healthy_engine_go_stale_are_refused() -> None:
    """An interval of 5 s with the default stale window of 3 s: every engine went stale for
    2 s of every 5, and every request then was answered 503 (review, stop 70)."""
    import pytest

    from kvfabric.runtime.config import SettingsError

    engines = json.dumps([{"id": "well", "url": WELL}])
    with pytest.raises(SettingsError, match="HEALTH_STALE_MS"):
        load_router_settings({**ENV, "KVF_ROUTER_ENGINES": engines, "KVF_ROUTER_HEALTH_INTERVAL_MS": "5000"})
    load_router_settings({**ENV, "KVF_ROUTER_ENGINES": engines})  # 500 + 2000 < 3000: the defaults fit

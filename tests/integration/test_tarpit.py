"""The tarpit against a real nats-server (`kvfabric.runtime.tarpit`, issue 21 row 2): a tenant
refused `busy` past the threshold has its work requests taken by a link that never reads them —
they time out at the sender, the service receives about 1 in `weight + 1` — while the other
tenants and the tenant's own give-backs are answered as before; the tarpit ends on time, and a
link the server closes is opened again while it lasts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

import msgspec
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient

from kvfabric.format.errors import Busy
from kvfabric.proto.subjects import Service, service_group, tenant_inbox_prefix
from kvfabric.runtime.config import RuntimeSettings
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.runtime.tarpit_core import TarpitConfig
from kvfabric.testing.nats_server import NatsServer

pytestmark = pytest.mark.integration

TARPIT_S = 1.5
REFUSALS = 5
GROUP = service_group(Service.ECHO)


class Done(msgspec.Struct):
    tenant: str


class Harness:
    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime
        self.handled: dict[str, int] = {}


@contextlib.asynccontextmanager
async def service(url: str) -> AsyncIterator[Harness]:
    settings = RuntimeSettings(nats_url=url, metrics_port=-1, inflight_max=64)
    runtime = ServiceRuntime(
        Service.ECHO,
        settings,
        version="0.0.1",
        description="tarpit test",
        tenant_refusal_hold_ms=0,  # refusals at once: the test counts them quickly
        tarpit=TarpitConfig(refusals_max=REFUSALS, duration_s=TARPIT_S),
    )
    harness = Harness(runtime)

    async def work(data: bytes, headers: Mapping[str, str], tenant: str) -> msgspec.Struct:
        harness.handled[tenant] = harness.handled.get(tenant, 0) + 1
        if tenant == "bob":
            busy = Busy("bob is over his budget")
            busy.tenants_own = True  # his own doing, as the directory's fair admission says
            raise busy
        if tenant == "carol":
            raise Busy("a table for all is full")  # not her doing: never counts
        return Done(tenant)

    async def give(data: bytes, headers: Mapping[str, str], tenant: str) -> msgspec.Struct:
        return Done(tenant)

    runtime.add_tenant_endpoint("work", work)
    runtime.add_tenant_endpoint("give", give, gives_back=True)
    await runtime.start()
    try:
        yield harness
    finally:
        await runtime.stop()


async def tenant_client(url: str, tenant: str) -> NatsClient:
    return await nats.connect(url, inbox_prefix=tenant_inbox_prefix(tenant), allow_reconnect=False)


async def ask(nc: NatsClient, tenant: str, verb: str, timeout_s: float) -> str:
    """'ok', 'busy' (any error reply) or 'timeout'."""
    try:
        msg = await nc.request(f"{GROUP}.t.{tenant}.{verb}", b"", timeout=timeout_s)
    except nats.errors.TimeoutError:
        return "timeout"
    return "busy" if msg.headers and msg.headers.get("Nats-Service-Error-Code") else "ok"


async def wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def test_a_flooding_tenant_is_tarpitted_and_the_others_are_not(nats_server: NatsServer) -> None:
    async with service(nats_server.url) as svc:
        bob = await tenant_client(nats_server.url, "bob")
        alice = await tenant_client(nats_server.url, "alice")
        try:
            tarpit = svc.runtime.tarpit
            assert tarpit is not None
            assert [await ask(bob, "bob", "work", 2.0) for _ in range(REFUSALS)] == ["busy"] * REFUSALS
            await wait_for(lambda: tarpit.link_tenants == {"bob"})
            assert svc.runtime.metrics.tarpit_entries._value.get() == 1

            handled_before = svc.handled["bob"]
            answers = await asyncio.gather(*(ask(bob, "bob", "work", 0.5) for _ in range(64)))
            # 1 in 64 reach the service (binomial: 14+ of 64 by chance ~1e-12)
            assert answers.count("timeout") >= 50, answers
            assert svc.handled["bob"] - handled_before == answers.count("busy")
            assert [await ask(alice, "alice", "work", 2.0) for _ in range(20)] == ["ok"] * 20
            assert [await ask(bob, "bob", "give", 2.0) for _ in range(20)] == ["ok"] * 20  # give-backs go on

            assert svc.runtime.metrics.tenants_tarpitted._value.get() == 1
            await wait_for(lambda: tarpit.link_tenants == frozenset(), timeout_s=TARPIT_S + 2)
            assert tarpit.core.tarpitted() == frozenset()
            await wait_for(lambda: svc.runtime.metrics.tenants_tarpitted._value.get() == 0)
            assert svc.runtime.metrics.tarpit_links._value.get() == tarpit.links_opened_total >= 1
            assert await ask(bob, "bob", "work", 2.0) == "busy"  # answered again
            # ... and on probation: a quarter of the threshold (1 here) tarpits him again, longer
            await wait_for(lambda: tarpit.link_tenants == {"bob"})
            until = tarpit.core.until_s("bob")
            assert until is not None and until - asyncio.get_running_loop().time() > TARPIT_S * 1.5
        finally:
            await bob.close()
            await alice.close()


async def test_refusals_that_are_not_the_tenants_doing_never_tarpit_it(nats_server: NatsServer) -> None:
    async with service(nats_server.url) as svc:
        carol = await tenant_client(nats_server.url, "carol")
        try:
            answers = [await ask(carol, "carol", "work", 2.0) for _ in range(REFUSALS * 4)]
            assert answers == ["busy"] * (REFUSALS * 4)
            assert svc.runtime.tarpit is not None and svc.runtime.tarpit.core.tarpitted() == frozenset()
        finally:
            await carol.close()


async def test_a_link_the_server_closes_is_opened_again_while_the_tarpit_lasts(
    nats_server: NatsServer,
) -> None:
    async with service(nats_server.url) as svc:
        tarpit = svc.runtime.tarpit
        assert tarpit is not None
        tarpit.core.config = TarpitConfig(refusals_max=REFUSALS, duration_s=30.0)
        bob = await tenant_client(nats_server.url, "bob")
        try:
            for _ in range(REFUSALS):
                await ask(bob, "bob", "work", 2.0)
            await wait_for(lambda: tarpit.link_tenants == {"bob"})
            link = tarpit._link
            assert link is not None
            link.writer.transport.abort()  # as a server closing a slow consumer
            await wait_for(lambda: tarpit._link is not link and tarpit.link_tenants == {"bob"})
            assert tarpit.links_opened_total >= 2
            answers = await asyncio.gather(*(ask(bob, "bob", "work", 0.5) for _ in range(32)))
            assert answers.count("timeout") >= 24, answers
        finally:
            await bob.close()
        await svc.runtime.stop_serving()
        assert tarpit._link is None  # a stop closes the link

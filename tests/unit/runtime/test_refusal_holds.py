"""The runtime holds a tenant's refusals past its in-flight share (issue 21 row 2): answered
`tenant_refusal_hold_ms` after receipt, not at once, so a flooder that never backs off asks at
most once a hold per held request; bounded per tenant and in all (past that: at once), and a
stop answers every held refusal at once. No NATS: requests go straight to the dispatcher."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from types import SimpleNamespace

import msgspec
import pytest

from kvfabric.format.errors import Busy
from kvfabric.format.invariant import InvariantViolation
from kvfabric.proto.common import ERROR_CODE_HEADER
from kvfabric.proto.subjects import Service, service_group
from kvfabric.runtime.config import RuntimeSettings
from kvfabric.runtime.inflight import Admission
from kvfabric.runtime.service import RuntimeState, ServiceRuntime

HOLD_MS = 150


class Done(msgspec.Struct):
    ok: bool = True


class FakeRequest:
    """What the dispatcher reads of a nats.micro request, and the answers it sends."""

    def __init__(self, tenant: str, verb: str) -> None:
        self.subject = f"{service_group(Service.ECHO)}.t.{tenant}.{verb}"
        self._msg = SimpleNamespace(reply=f"_INBOX.t.{tenant}.reply")
        self.headers: dict[str, str] | None = None
        self.data = b""
        self.sent_s = time.perf_counter()
        self.answers: list[tuple[float, str]] = []  # (seconds after it was built, error code or ok)

    async def respond(self, data: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
        self.answers.append((time.perf_counter() - self.sent_s, "ok"))

    async def respond_error(
        self, code: str, description: str, data: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> None:
        self.answers.append((time.perf_counter() - self.sent_s, (headers or {})[ERROR_CODE_HEADER]))


class Harness:
    """A running runtime (no NATS) with a new-work and a give-back tenant endpoint whose
    handlers wait until `release` is set (`refusing`: and three whose handlers refuse, held)."""

    def __init__(self, *, inflight_max: int, hold_ms: int, refusing: bool = False) -> None:
        settings = RuntimeSettings(metrics_port=-1, inflight_max=inflight_max, shutdown_grace_ms=10)
        self.runtime = ServiceRuntime(
            Service.ECHO, settings, version="0.0.1", description="test", tenant_refusal_hold_ms=hold_ms
        )
        self.release = asyncio.Event()

        async def handler(data: bytes, headers: Mapping[str, str], tenant: str) -> msgspec.Struct:
            await self.release.wait()
            return Done()

        async def refuse(data: bytes, headers: Mapping[str, str], tenant: str) -> msgspec.Struct:
            busy = Busy.own("tenant's budget spent")
            busy.hold_s = HOLD_MS / 1000  # as the directory's fair admission refuses
            raise busy

        async def refuse_service(data: bytes, headers: Mapping[str, str]) -> msgspec.Struct:
            return await refuse(data, headers, "")

        self.runtime.add_tenant_endpoint("work", handler)
        self.runtime.add_tenant_endpoint("give", handler, gives_back=True)
        if refusing:  # endpoints whose handlers refuse with a hold
            self.runtime.add_tenant_endpoint("refuse", refuse)
            self.runtime.add_tenant_endpoint("refuse_give", refuse, gives_back=True)
            self.runtime.add_endpoint("refuse_service", refuse_service)
        self.runtime._state = RuntimeState.RUNNING  # as after `start`, without NATS

    async def send_service(self) -> FakeRequest:
        """A service's request (no tenant) whose handler refuses with a hold."""
        request = FakeRequest("svc", "refuse_service")
        await self.runtime._dispatch(self.runtime._endpoints["refuse_service"], request)  # type: ignore[arg-type]
        return request

    async def send(self, tenant: str, verb: str = "work") -> FakeRequest:
        request = FakeRequest(tenant, verb)
        endpoint = self.runtime._endpoints[f"tenant_{verb}"]
        await self.runtime._dispatch(endpoint, request)  # type: ignore[arg-type]
        return request


def codes(requests: list[FakeRequest]) -> list[list[str]]:
    return [[code for _, code in r.answers] for r in requests]


async def test_a_refusal_past_the_tenants_share_is_held_then_busy() -> None:
    svc = Harness(inflight_max=8, hold_ms=HOLD_MS)  # bob's share: 2
    admitted = [await svc.send("bob") for _ in range(2)]
    refused = await svc.send("bob")
    assert refused.answers == [] and svc.runtime.refusals_held == 1  # not answered at once
    alice = await svc.send("alice")  # the other tenants are admitted meanwhile
    assert svc.runtime.inflight_count == 3
    await asyncio.sleep(HOLD_MS / 1000 + 0.1)
    assert codes([refused]) == [["busy"]] and svc.runtime.refusals_held == 0
    assert refused.answers[0][0] >= HOLD_MS / 1000 - 0.005, refused.answers
    svc.release.set()
    await asyncio.sleep(0.05)
    assert codes([*admitted, alice]) == [["ok"]] * 3
    await svc.runtime.stop()


async def test_held_refusals_are_bounded_per_tenant_and_in_all() -> None:
    """Past a tenant's share of held refusals, or the runtime's, the refusal is answered at once;
    a full lane (not the tenant's share) is answered at once too."""
    svc = Harness(inflight_max=4, hold_ms=5_000)  # share 1; 4 held in all
    for tenant in ("a", "b", "c", "d"):
        await svc.send(tenant)  # the new-work lane is full
        await svc.send(tenant, "give")  # and the give-back lane
    held = [await svc.send(t) for t in ("a", "b")] + [await svc.send(t, "give") for t in ("c", "d")]
    assert codes(held) == [[]] * 4 and svc.runtime.refusals_held == 4
    at_once = [await svc.send("a", "give"), await svc.send("d"), await svc.send("e")]
    assert codes(at_once) == [["busy"]] * 3  # the bound in all; then a full lane, a new tenant
    assert all(r.answers[0][0] < 1.0 for r in at_once)
    assert svc.runtime.refusals_held == 4
    await svc.runtime.stop()


async def test_a_tenant_past_its_share_of_held_refusals_is_answered_at_once() -> None:
    svc = Harness(inflight_max=8, hold_ms=5_000)  # share 2: 2 running, 2 held
    for _ in range(4):
        await svc.send("bob")
    fifth = await svc.send("bob")
    assert codes([fifth]) == [["busy"]] and svc.runtime.refusals_held == 2
    await svc.runtime.stop()


async def test_a_stop_answers_every_held_refusal_at_once() -> None:
    svc = Harness(inflight_max=8, hold_ms=5_000)
    for _ in range(2):
        await svc.send("bob")
    held = [await svc.send("bob"), await svc.send("bob")]
    started_s = time.perf_counter()
    await asyncio.wait_for(svc.runtime.stop(), 2.0)
    assert time.perf_counter() - started_s < 1.0
    assert codes(held) == [["unavailable"]] * 2
    assert svc.runtime.refusals_held == 0 and not svc.runtime._held_tasks


@pytest.mark.parametrize("verb", ["refuse", "refuse_give"])
async def test_a_handlers_held_refusal_gives_its_lane_slot_back_at_once(verb: str) -> None:
    """A handler's `Busy` with a `hold_s` (the directory's fair admission) is answered after
    it, in a held task: the handler's lane slot is free meanwhile. Slept in the handler, the
    hold kept the slot: four tenants' held refusals filled the give-back lane and segments'
    heartbeats in it were refused (review, stop 67)."""
    svc = Harness(inflight_max=8, hold_ms=5_000, refusing=True)  # share 2, 1 of each lane reserved
    refused = []
    for tenant in ("a", "a", "b", "b", "c", "c", "d", "d"):
        refused.append(await svc.send(tenant, verb))
        await asyncio.sleep(0.005)  # its handler ran and raised: its slot is free again
    assert svc.runtime.inflight_count == 0 and svc.runtime.refusals_held == 8
    assert codes(refused) == [[]] * 8  # held
    service = await svc.send_service()
    await asyncio.sleep(HOLD_MS / 1000 + 0.1)
    assert codes(refused) == [["busy"]] * 8 and svc.runtime.refusals_held == 0
    assert all(r.answers[0][0] >= HOLD_MS / 1000 - 0.005 for r in refused)
    assert codes([service]) == [["busy"]]  # a service request's refusal: at once, no hold
    assert service.answers[0][0] < HOLD_MS / 1000
    extra = []
    for _ in range(3):
        extra.append(await svc.send("a", verb))
        await asyncio.sleep(0.005)
    # past a's share of held refusals: held in its handler's slot, as before (answered at once,
    # each next request of a flood would run its handler at once; review of the fix)
    assert codes(extra) == [[], [], []] and svc.runtime.inflight_count == 1
    await asyncio.wait_for(svc.runtime.stop(), 2.0)
    assert codes(extra) == [["unavailable"], ["unavailable"], ["busy"]]  # a stop answers them


async def test_a_tenant_past_the_tenants_part_of_a_lane_is_held_not_counted() -> None:
    """All tenants together hold at most 7/8 of a lane; a tenant refused past that (below its
    own share) was answered at once and uncounted, so the fourth of four flooding tenants
    escaped both the hold and the tarpit (review of the fix, stop 67). Now held, not counted."""
    svc = Harness(inflight_max=8, hold_ms=HOLD_MS)  # share 2, tenants' part 7
    for tenant in ("a", "a", "b", "b", "c", "c", "d"):
        await svc.send(tenant)  # the handlers wait: 7 slots held by tenants
    refused = await svc.send("d")  # d holds 1, below its share: the tenants' part is full
    assert refused.answers == [] and svc.runtime.refusals_held == 1
    assert svc.runtime._limiter.tenant_rejected_total == 0  # not d's own doing
    await asyncio.sleep(HOLD_MS / 1000 + 0.1)
    assert codes([refused]) == [["busy"]] and refused.answers[0][0] >= HOLD_MS / 1000 - 0.005
    assert svc.runtime._limiter.try_acquire(None) is Admission.ADMITTED  # a service's: the reserve
    svc.runtime._limiter.release(None)
    svc.release.set()
    await svc.runtime.stop()


async def test_no_hold_answers_at_once() -> None:
    svc = Harness(inflight_max=8, hold_ms=0)
    for _ in range(2):
        await svc.send("bob")
    refused = await svc.send("bob")
    assert codes([refused]) == [["busy"]] and svc.runtime.refusals_held == 0
    await svc.runtime.stop()


@pytest.mark.parametrize("hold_ms", [-1, 10_001])
def test_the_hold_is_bounded(hold_ms: int) -> None:
    settings = RuntimeSettings(metrics_port=-1)
    with pytest.raises(InvariantViolation):
        ServiceRuntime(Service.ECHO, settings, version="0", description="t", tenant_refusal_hold_ms=hold_ms)

"""Which refusals count towards a tenant's tarpit (`ServiceRuntime._note_refusal`): its share of
the in-flight slots spent (its own doing), never a full lane (the other tenants' doing), never a
give-back; and which subjects the tarpit takes (not give-backs, not endpoints registered
`tarpittable=False`). No NATS: requests go straight to the dispatcher
(`test_refusal_holds.Harness`), and the tarpit is never run."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import pytest

from kvfabric.cluster.natsauth import NatsAuth
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import RuntimeState
from kvfabric.runtime.tarpit import TenantTarpit
from kvfabric.runtime.tarpit_core import TarpitConfig, TarpitCore
from tests.unit.runtime.test_refusal_holds import Done, Harness, codes


async def report(data: bytes, headers: Mapping[str, str], tenant: str) -> msgspec.Struct:
    return Done()


def harness() -> Harness:
    """`Harness`'s work and give-back endpoints, and a `report` endpoint the tarpit never takes."""
    svc = Harness(inflight_max=4, hold_ms=0)  # a tenant's share: 1
    svc.runtime._state = RuntimeState.CREATED
    svc.runtime.add_tenant_endpoint("report", report, tarpittable=False)
    svc.runtime._state = RuntimeState.RUNNING
    return svc


def with_tarpit(svc: Harness, refusals: int) -> TenantTarpit:
    tarpit = TenantTarpit(
        TarpitCore(TarpitConfig(refusals_max=refusals)),
        subjects_for=svc.runtime._tarpit_subjects,
        queue=svc.runtime.group,
        server=lambda: None,
        auth=NatsAuth(),
        name="test",
        log=get_logger("test"),
    )
    svc.runtime._tarpit = tarpit
    return tarpit


async def test_only_refusals_of_the_tenants_own_share_count() -> None:
    svc = harness()
    tarpit = with_tarpit(svc, refusals=3)
    for tenant in ("a", "b", "c", "d"):
        await svc.send(tenant)  # the lane is full: each holds its share
    full = [await svc.send("e") for _ in range(6)]  # the lane full: not e's doing
    assert codes(full) == [["busy"]] * 6 and tarpit.core.tarpitted() == frozenset()
    for tenant in ("a", "b", "c", "d"):
        await svc.send(tenant, "give")  # the give-back lane full too
    gives = [await svc.send("a", "give") for _ in range(6)]  # a give-back past a's share
    assert codes(gives) == [["busy"]] * 6 and tarpit.core.tarpitted() == frozenset()
    own = [await svc.send("a") for _ in range(3)]  # a's own share spent, three times
    assert codes(own) == [["busy"]] * 3 and tarpit.core.tarpitted() == {"a"}
    await svc.runtime.stop()


def test_the_tarpit_takes_only_work_endpoints() -> None:
    svc = harness()
    subjects = svc.runtime._tarpit_subjects("bob")
    assert subjects == [f"{svc.runtime.group}.t.bob.work"]  # not `give`, not `report`


async def test_a_held_refusal_counts_when_decided_and_the_listener_hears_the_tarpit() -> None:
    """A refusal past the tenant's share counts towards its tarpit as it is decided, not when
    its held answer goes out 5 s later (before, the tenant's requests kept arriving for the
    hold's length before it was tarpitted); whichever refusal tarpits a tenant, the runtime's
    listener (the directory's fair admission suspends its bucket) hears (tenant, seconds)."""
    svc = Harness(inflight_max=4, hold_ms=5_000)  # a's share: 1; refusals held 5 s
    tarpit = with_tarpit(svc, refusals=3)
    tarpit._on_tarpitted = svc.runtime._tarpitted  # as `_start_tarpit` wires it
    heard: list[tuple[str, float]] = []
    svc.runtime.on_tenant_tarpitted(lambda tenant, seconds: heard.append((tenant, seconds)))
    await svc.send("a")  # a's share in flight
    held = [await svc.send("a") for _ in range(3)]  # its third refusal tarpits it
    # the first held (5 s), the others answered at once (a tenant's share of held refusals)
    assert codes(held) == [[], ["busy"], ["busy"]]
    assert tarpit.core.tarpitted() == {"a"} and heard == [("a", 2.0)]
    svc.runtime.note_tenant_refusal("b")  # a handler's own count (fair admission's)
    assert tarpit.core.tarpitted() == {"a"}  # one of b's three
    await svc.runtime.stop()


@pytest.mark.parametrize("hold_ms", [5_000, 0])
async def test_a_tenant_refused_past_the_tenants_part_counts_once_its_held_share_is_full(
    hold_ms: int,
) -> None:
    """All tenants together hold 7/8 of a lane; a tenant refused past that is not refused of its
    own doing, and is held, not counted. Once its own share of held refusals is full it does not
    back off: answered at once, those count (else a flood past the part was never tarpitted;
    review of the fix, stop 67). With holds off nobody's is full: never counted (review)."""
    svc = Harness(inflight_max=8, hold_ms=hold_ms)  # share 2, tenants' part 7
    tarpit = with_tarpit(svc, refusals=3)
    for tenant in ("a", "a", "b", "b", "c", "c", "d"):
        await svc.send(tenant)  # 7: the tenants' part
    refused = [await svc.send("d") for _ in range(5)]  # d below its share: the part is full
    held = 2 if hold_ms else 0  # d's share of held refusals
    assert codes(refused) == [[]] * held + [["busy"]] * (5 - held)
    assert tarpit.core.tarpitted() == ({"d"} if hold_ms else frozenset())
    assert svc.runtime.inflight_count == 7  # the services' slot is free
    svc.release.set()
    await svc.runtime.stop()

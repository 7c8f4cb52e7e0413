"""A lane's in-flight slots with a per-tenant share: a tenant is refused past its share, the
others are not; service requests take only from the shared bound; two lanes (new work,
gives-back) never take from each other (issue 20)."""

from __future__ import annotations

import pytest

from kvfabric.format.invariant import InvariantViolation
from kvfabric.runtime.inflight import Admission, TenantLimiter


def test_a_tenant_is_refused_past_its_share_and_the_others_are_not() -> None:
    lane = TenantLimiter(4, 2)
    assert [lane.try_acquire("bob") for _ in range(3)] == [Admission.ADMITTED] * 2 + [Admission.TENANT_FULL]
    assert lane.try_acquire("alice") is Admission.ADMITTED
    assert lane.try_acquire(None) is Admission.ADMITTED  # a service's request: no share
    assert lane.try_acquire("carol") is Admission.FULL
    assert (lane.count, lane.tenant_count("bob"), lane.rejected_total, lane.tenant_rejected_total) == (
        4,
        2,
        2,
        1,
    )

    lane.release("bob")
    assert lane.try_acquire("bob") is Admission.ADMITTED
    for tenant in ("bob", "bob", "alice", None):
        lane.release(tenant)
    assert (lane.count, lane.tenant_count("bob"), lane.tenant_count("alice")) == (0, 0, 0)


def test_gives_back_never_wait_behind_new_work() -> None:
    """The runtime's two lanes: new work filling the tenant's share and the whole bound leaves
    every give-back slot free, and a give-back flood leaves new work's slots free."""
    work, gives = TenantLimiter(8, 2), TenantLimiter(8, 2)
    while work.try_acquire(None) is Admission.ADMITTED:
        pass
    assert work.try_acquire("bob") is Admission.FULL
    assert [gives.try_acquire("bob") for _ in range(3)] == [Admission.ADMITTED] * 2 + [Admission.TENANT_FULL]
    assert gives.try_acquire("alice") is Admission.ADMITTED  # bob's flood starves no one else
    work.release(None)
    assert work.try_acquire("bob") is Admission.ADMITTED


def test_tenants_together_leave_the_service_reserve() -> None:
    """Four tenants at their share (a quarter each) held the whole lane, and segments'
    heartbeats, sharing the give-back lane, were refused (review, stop 67): all tenants together
    now stop `service_reserve` short of the bound, which only service requests may take."""
    lane = TenantLimiter(8, 2, service_reserve=2)
    for tenant in ("a", "b", "c"):
        assert [lane.try_acquire(tenant) for _ in range(2)] == [Admission.ADMITTED] * 2
    assert lane.try_acquire("d") is Admission.TENANTS_FULL  # 6 = 8 - 2: the rest is the services'
    assert [lane.try_acquire(None) for _ in range(3)] == [Admission.ADMITTED] * 2 + [Admission.FULL]
    lane.release("a")
    assert lane.try_acquire("d") is Admission.ADMITTED
    lane.release(None)  # a service's slot free: still not the tenants'
    assert lane.try_acquire("d") is Admission.TENANTS_FULL and lane.count == 7
    with pytest.raises(InvariantViolation):
        TenantLimiter(2, 1, service_reserve=2)


def test_release_without_acquire_is_a_bug() -> None:
    lane = TenantLimiter(2, 1)
    assert lane.try_acquire("bob") is Admission.ADMITTED
    with pytest.raises(InvariantViolation, match="tenant in-flight release without acquire"):
        lane.release("alice")


def test_share_must_fit_the_bound() -> None:
    with pytest.raises(InvariantViolation):
        TenantLimiter(2, 3)
    with pytest.raises(InvariantViolation):
        TenantLimiter(2, 0)

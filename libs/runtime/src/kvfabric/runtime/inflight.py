"""The in-flight limit: a counter with a hard bound, no queue, no event loop.

States: `count` in 0..`limit`. `try_acquire` either takes a slot (count + 1) or refuses when
`count == limit`: the caller then answers `Busy` at once instead of queueing, so memory and
latency stay bounded under overload. `release` gives a slot back; releasing more than was
acquired is a bug (`InvariantViolation`). `TenantLimiter` adds a per-tenant share on top.
"""

from __future__ import annotations

import enum

from kvfabric.format.invariant import invariant

__all__ = ["Admission", "InflightLimiter", "TenantLimiter"]


class InflightLimiter:
    def __init__(self, limit: int) -> None:
        invariant(limit >= 1, "in-flight limit must be at least 1", limit=limit)
        self._limit = limit
        self._count = 0
        self.rejected_total = 0

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def count(self) -> int:
        return self._count

    @property
    def full(self) -> bool:
        return self._count >= self._limit

    def try_acquire(self) -> bool:
        """Take a slot if one is free. Never waits."""
        if self._count >= self._limit:
            self.rejected_total += 1
            return False
        self._count += 1
        invariant(
            self._count <= self._limit, "in-flight count above limit", count=self._count, limit=self._limit
        )
        return True

    def release(self) -> None:
        invariant(self._count > 0, "in-flight release without acquire")
        self._count -= 1


class Admission(enum.Enum):
    """What `TenantLimiter.try_acquire` decided."""

    ADMITTED = "admitted"
    TENANT_FULL = "tenant_full"  # the tenant holds its whole share of the slots
    TENANTS_FULL = "tenants_full"  # all tenants together hold theirs (the rest: services')
    FULL = "full"  # every slot is taken


class TenantLimiter:
    """An `InflightLimiter` of which one tenant holds at most `tenant_limit` slots.

    States: `count` in 0..`limit`, each tenant's count in 1..`tenant_limit` (a tenant holding
    none is forgotten, so the table is bounded by `limit`), all tenants' together at most `limit
    - service_reserve`. Requests that name no tenant (service endpoints) take only from the
    shared bound, so `service_reserve` slots are always theirs: with a share of a quarter, four
    flooding tenants held every slot and segments' heartbeats were refused (review, stop 67).
    `try_acquire` never waits: a refusal says which bound refused (the caller answers `Busy`;
    tenants past the reserve: `TENANTS_FULL`, not the refused tenant's own doing). A runtime
    keeps one per lane (new work, gives-back: `kvfabric.runtime.service`), so the lanes never
    wait on each other.
    """

    def __init__(self, limit: int, tenant_limit: int, service_reserve: int = 0) -> None:
        invariant(
            1 <= tenant_limit <= limit, "tenant share must be in 1..limit", limit=limit, tenant=tenant_limit
        )
        invariant(
            0 <= service_reserve < limit,
            "service reserve must be in 0..limit-1",
            limit=limit,
            reserve=service_reserve,
        )
        self._slots = InflightLimiter(limit)
        self._tenant_limit = tenant_limit
        self._tenants: dict[str, int] = {}
        self._tenants_total = 0  # slots all tenants hold: at most limit - service_reserve
        self.service_reserve = service_reserve
        self.tenant_rejected_total = 0  # refused because the tenant held its share

    @property
    def limit(self) -> int:
        return self._slots.limit

    @property
    def tenant_limit(self) -> int:
        return self._tenant_limit

    @property
    def count(self) -> int:
        return self._slots.count

    @property
    def rejected_total(self) -> int:
        """Every refusal: the shared bound's and the tenants' shares'."""
        return self._slots.rejected_total + self.tenant_rejected_total

    def tenant_count(self, tenant: str) -> int:
        return self._tenants.get(tenant, 0)

    def try_acquire(self, tenant: str | None) -> Admission:
        """Take a slot for `tenant` (None: a service request) if its share and the bound allow."""
        if tenant is not None:
            if self._tenants.get(tenant, 0) >= self._tenant_limit:
                self.tenant_rejected_total += 1
                return Admission.TENANT_FULL
            if self._tenants_total >= self._slots.limit - self.service_reserve:
                self._slots.rejected_total += 1
                return Admission.TENANTS_FULL
        if not self._slots.try_acquire():
            return Admission.FULL
        if tenant is not None:
            self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
            self._tenants_total += 1
        return Admission.ADMITTED

    def release(self, tenant: str | None) -> None:
        if tenant is not None:
            held = self._tenants.get(tenant, 0)
            invariant(held > 0, "tenant in-flight release without acquire", tenant=tenant)
            if held > 1:
                self._tenants[tenant] = held - 1
            else:
                del self._tenants[tenant]
            self._tenants_total -= 1
        self._slots.release()

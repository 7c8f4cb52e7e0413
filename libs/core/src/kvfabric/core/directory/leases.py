"""The lease table: read leases (granted by lookups) and pins (asked by services and tenants).

## States of a lease or pin
    (absent) --lookup hit / pin of published groups (not lost)--> HELD(expires_ms)
    HELD --renew (leases only)--> HELD(later expiry; never earlier; unchanged while the lease
        holds a deferred group)
    HELD --lookup_more (a lookup run in slices)--> HELD(more groups, same expiry)
    HELD --release / unpin / tick at or after expires_ms--> (absent)
A held lease or pin counts once per group it names in the published table (`hold`); a group
held is never evicted, and one that lost its last replica meanwhile is invalidated only when its
last hold ends (a pin holds it only while it has replicas left to free: `published`). An expiry
only makes groups evictable: it frees no memory by itself. So no hold on a lost group outlasts
the holds it had when lost (`published`, "lost"): a pin skips lost groups (it pins only the
others), and a renew of a lease holding a deferred group answers its
expiry unchanged (the reader's read tokens end there anyway; a new lookup skips the lost group).
Before (review), re-pinning a lost group before its pin expired, or renewing a lease on it,
kept it deferred for ever.

## Unpinned groups
A group whose last pin ends (unpin, or the pin's expiry) is told to the eviction policy
(`GroupsUnpinned`): it backs off a victim refused as pinned for up to 80 s and would otherwise
learn of the unpin only by asking again. Gathered until the next tick (`flush_unpinned`, at
most `ACCESS_BATCH_MAX` groups an event), as lookup hits are: a tenant pinning and unpinning
in a loop makes one event a tick, not one per unpin (review). What waits is at most the groups
pinned, each once.

## Invariants (`check_invariants`)
1. The published table's lease and pin counts are exactly the groups of the held leases and pins.
2. `pins_held` is the number of pins; the per-tenant counts are the leases and pins held by each
   tenant's scoped holders (`<tenant>/<holder>`), and the groups they name.
3. Every lease's expiry has an entry in the expiry heap.

## Bounds
`leases_max` read leases and `pins_max` pins (then `busy`), of which one tenant holds at most
`tenant_leases_max` / `tenant_pins_max`, naming at most `tenant_lease_groups_max` /
`tenant_pin_groups_max` groups in all (each named group is a key the lease keeps, ~90 bytes:
bounded by entries alone, a tenant's 2,500 pins of 4,096 groups held ~0.9 GB; review,
2026-12-05). A lookup's later slice that would pass the groups bound is not leased: its fold
ends there (a shorter hit). A pin lasts at most PIN_TTL_MS_MAX (a tenant's
`tenant_pin_ttl_ms_max`), a lease `lease_ttl_ms_max`. The expiry heap holds at most twice the
leases held plus HEAP_SLACK_MIN entries (renewals leave stale ones; it is rebuilt past that).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvfabric.core.directory.base import (
    HEAP_SLACK_MIN,
    Context,
    Effect,
    EmitEvent,
    Outcome,
    check_batch,
    scope_of,
)
from kvfabric.core.directory.keys import GroupInfo, chain_of, domain_of, parse_group
from kvfabric.core.directory.published import PublishedTable
from kvfabric.core.quotas import request_tokens
from kvfabric.format.errors import BadRequest, Busy, NotFound
from kvfabric.format.ids import GroupKey
from kvfabric.format.invariant import invariant
from kvfabric.proto import directory as m

__all__ = ["Lease", "LeaseTable"]


@dataclass(slots=True)
class Lease:
    holder_id: str
    groups: tuple[GroupKey, ...]
    expires_ms: int
    is_pin: bool


class LeaseTable:
    def __init__(self, ctx: Context, published: PublishedTable) -> None:
        self.ctx = ctx
        self.published = published
        self.leases: dict[int, Lease] = {}  # read leases and pins, in id order
        self.pins_held = 0
        self._heap: list[tuple[int, int]] = []  # (expires_ms, lease id)
        # (tenant scope of the holder id, is_pin) -> leases or pins held (tenant holders only)
        self._scope_held: dict[tuple[str, bool], int] = {}
        # ... -> the groups they name
        self._scope_groups: dict[tuple[str, bool], int] = {}
        # groups whose last pin ended since the last tick (`flush_unpinned`), each once
        self.unpinned: dict[GroupKey, None] = {}

    def grant(
        self, holder_id: str, groups: tuple[GroupKey, ...], expires_ms: int, *, is_pin: bool
    ) -> tuple[int, int]:
        config = self.ctx.config
        limit = config.pins_max if is_pin else config.leases_max
        held = self.pins_held if is_pin else len(self.leases) - self.pins_held
        if held >= limit:
            self.ctx.count("busy_pins_total" if is_pin else "busy_leases_total")
            raise Busy("lease table full; retry later", limit=limit)
        scope = scope_of(holder_id)
        if scope is not None:
            scope_limit = config.tenant_pins_max if is_pin else config.tenant_leases_max
            if self._scope_held.get((scope, is_pin), 0) >= scope_limit:
                self.ctx.count("busy_tenant_pins_total" if is_pin else "busy_tenant_leases_total")
                share = "this tenant holds its share of the lease table; retry later"
                raise Busy(share, limit=scope_limit)
            if not self._groups_fit(scope, is_pin, len(groups)):
                self.ctx.count("busy_tenant_pin_groups_total" if is_pin else "busy_tenant_lease_groups_total")
                raise Busy("this tenant's leases or pins hold their share of groups; retry later")
            self._scope_held[(scope, is_pin)] = self._scope_held.get((scope, is_pin), 0) + 1
            self._scope_groups[(scope, is_pin)] = self._scope_groups.get((scope, is_pin), 0) + len(groups)
        lease_id = self.ctx.next_id()
        self.leases[lease_id] = Lease(holder_id, groups, expires_ms, is_pin)
        self.pins_held += is_pin
        self._push(expires_ms, lease_id)
        for gid in groups:
            self.published.hold(gid, is_pin)
        return lease_id, expires_ms

    def live_lease(self, holder_id: str, lease_id: int, now_ms: int) -> Lease | None:
        """A read lease `holder_id` holds that has not expired by `now_ms`."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.holder_id != holder_id or lease.is_pin or lease.expires_ms <= now_ms:
            return None
        return lease

    def _groups_fit(self, scope: str, is_pin: bool, more: int) -> bool:
        config = self.ctx.config
        limit = config.tenant_pin_groups_max if is_pin else config.tenant_lease_groups_max
        return self._scope_groups.get((scope, is_pin), 0) + more <= limit

    def may_extend(self, lease_id: int, more: int) -> bool:
        """Whether lease `lease_id` may name `more` groups (its tenant's groups bound)."""
        lease = self.leases[lease_id]
        scope = scope_of(lease.holder_id)
        if scope is None or self._groups_fit(scope, lease.is_pin, more):
            return True
        self.ctx.count("busy_tenant_pin_groups_total" if lease.is_pin else "busy_tenant_lease_groups_total")
        return False

    def extend(self, lease_id: int, groups: tuple[GroupKey, ...]) -> None:
        """More groups under a lease (a lookup's later slice), its expiry unchanged (the caller
        asked `may_extend`)."""
        lease = self.leases[lease_id]
        lease.groups += groups
        scope = scope_of(lease.holder_id)
        if scope is not None:
            self._scope_groups[(scope, lease.is_pin)] += len(groups)
        for gid in groups:
            self.published.hold(gid, lease.is_pin)

    def _end(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id)
        self.pins_held -= lease.is_pin
        scope = scope_of(lease.holder_id)
        if scope is not None:
            left = self._scope_held[(scope, lease.is_pin)] - 1
            if left:
                self._scope_held[(scope, lease.is_pin)] = left
                self._scope_groups[(scope, lease.is_pin)] -= len(lease.groups)
            else:
                del self._scope_held[(scope, lease.is_pin)]
                del self._scope_groups[(scope, lease.is_pin)]
        for gid in lease.groups:
            self.published.unhold(gid, lease.is_pin)
            if lease.is_pin and gid not in self.published.pin_count:
                self.unpinned[gid] = None
        self._bound_heap()

    def flush_unpinned(self, effects: list[Effect]) -> None:
        """Tell the eviction policy which groups lost their last pin (`GroupsUnpinned`)."""
        if not self.unpinned:
            return
        gids = list(self.unpinned)
        self.unpinned = {}
        self.ctx.count("groups_unpinned_total", len(gids))
        for at in range(0, len(gids), m.ACCESS_BATCH_MAX):
            refs = [m.GroupRef(chain_of(g), domain_of(g)) for g in gids[at : at + m.ACCESS_BATCH_MAX]]
            effects.append(EmitEvent("unpinned", m.GroupsUnpinned(groups=refs)))

    def _held_lease(self, holder_id: str, lease_id: int, is_pin: bool) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None or lease.holder_id != holder_id or lease.is_pin != is_pin:
            raise NotFound(
                f"no {'pin' if is_pin else 'lease'} {lease_id} held by {holder_id!r}", lease_id=lease_id
            )
        return lease

    def _push(self, expires_ms: int, lease_id: int) -> None:
        heapq.heappush(self._heap, (expires_ms, lease_id))
        self._bound_heap()

    def _bound_heap(self) -> None:
        if len(self._heap) > 2 * len(self.leases) + HEAP_SLACK_MIN:  # drop the stale entries
            self._heap = [(lease.expires_ms, i) for i, lease in self.leases.items()]
            heapq.heapify(self._heap)

    # ---- verbs ---------------------------------------------------------------------------

    def release(self, req: m.LeaseRelease, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        if req.lease_ids:
            return self._release_batch(req)
        self._held_lease(req.holder_id, req.lease_id, is_pin=False)
        self._end(req.lease_id)
        return Outcome(m.LeaseReply(epoch=self.ctx.epoch, lease_id=req.lease_id, expires_ms=0))

    def _release_batch(self, req: m.LeaseRelease) -> Outcome:
        """Every listed lease the holder holds ends; the others are skipped (released or expired
        already: nothing to give back, so a retried batch is a no-op), never an error."""
        if req.lease_id:
            raise BadRequest("a batch release names its leases in lease_ids only (lease_id 0)")
        check_batch("lease_release lease_ids", len(req.lease_ids), m.RELEASE_BATCH_LEASES_MAX)
        released = []
        for lease_id in req.lease_ids:
            lease = self.leases.get(lease_id)
            if lease is None or lease.holder_id != req.holder_id or lease.is_pin:
                continue
            self._end(lease_id)
            released.append(lease_id)
        return Outcome(m.LeaseReply(epoch=self.ctx.epoch, lease_id=0, expires_ms=0, released=released))

    def renew(self, req: m.LeaseRenew, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        if not 0 < req.lease_ttl_ms <= m.LEASE_TTL_MS_MAX:
            raise BadRequest(f"lease_ttl_ms must be in 1..{m.LEASE_TTL_MS_MAX}")
        lease = self._held_lease(req.holder_id, req.lease_id, is_pin=False)
        if lease.expires_ms <= now_ms:  # expired, its end waiting for a tick's budget: not revived
            raise NotFound(f"lease {req.lease_id} expired", lease_id=req.lease_id)
        if self.published.holds_deferred(lease.groups):  # a lost group's hold is never extended
            self.ctx.count("lease_renew_refused_lost_total")
            return Outcome(
                m.LeaseReply(epoch=self.ctx.epoch, lease_id=req.lease_id, expires_ms=lease.expires_ms)
            )
        ttl_ms = min(req.lease_ttl_ms, self.ctx.config.lease_ttl_ms_max)
        lease.expires_ms = max(lease.expires_ms, now_ms + ttl_ms)
        self._push(lease.expires_ms, req.lease_id)
        return Outcome(m.LeaseReply(epoch=self.ctx.epoch, lease_id=req.lease_id, expires_ms=lease.expires_ms))

    def pin(self, req: m.Pin, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        check_batch("pin groups", len(req.groups), m.LOOKUP_BATCH_GROUPS_MAX)
        if not 0 < req.ttl_ms <= m.PIN_TTL_MS_MAX:
            raise BadRequest(f"ttl_ms must be in 1..{m.PIN_TTL_MS_MAX}")
        self.ctx.check_rate(req.groups, now_ms, request_tokens(len(req.groups)))
        gids = tuple(info.group_id for info in map(parse_group, req.groups) if self._pinnable(info))
        if not gids:  # nothing to protect: no pin is held (an empty pin would only fill the table)
            return Outcome(m.PinReply(epoch=self.ctx.epoch, pin_id=0, pinned_groups=0, expires_ms=0))
        ttl_ms = req.ttl_ms
        if scope_of(req.holder_id) is not None:  # a tenant's pin: shortened to the tenant maximum
            ttl_ms = min(ttl_ms, self.ctx.config.tenant_pin_ttl_ms_max)
        pin_id, expires = self.grant(req.holder_id, gids, now_ms + ttl_ms, is_pin=True)
        return Outcome(
            m.PinReply(epoch=self.ctx.epoch, pin_id=pin_id, pinned_groups=len(gids), expires_ms=expires)
        )

    def _pinnable(self, info: GroupInfo) -> bool:
        """Published under `info`'s identity and not lost (a pin of a lost group would hold off
        its invalidation: `published`, "lost")."""
        group = self.published.published_as(info)
        return group is not None and not self.published.lost(info.group_id, group)

    def unpin(self, req: m.Unpin, now_ms: int) -> Outcome:
        self.ctx.check_epoch(req.epoch)
        self._held_lease(req.holder_id, req.pin_id, is_pin=True)
        self._end(req.pin_id)  # (the groups it was the last pin of are told by the next tick)
        return Outcome(m.PinReply(epoch=self.ctx.epoch, pin_id=req.pin_id, pinned_groups=0, expires_ms=0))

    def expire(self, now_ms: int) -> None:
        """Leases and pins whose time has come end, naming at most about `expire_batch_max`
        groups in all a tick (the rest at the next: each group named is a count to drop)."""
        ended, budget = 0, self.ctx.config.expire_batch_max
        while self._heap and self._heap[0][0] <= now_ms and ended < budget:
            _, lease_id = heapq.heappop(self._heap)
            ended += 1  # a stale entry (released, renewed) costs one too
            lease = self.leases.get(lease_id)
            if lease is not None and lease.expires_ms <= now_ms:
                self.ctx.count("pins_expired_total" if lease.is_pin else "leases_expired_total")
                ended += len(lease.groups)
                self._end(lease_id)
        if ended >= budget:
            self.ctx.count("expiry_deferred_ticks_total")

    # ---- checks --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        scoped: dict[tuple[str, bool], int] = {}
        scoped_groups: dict[tuple[str, bool], int] = {}
        counts: tuple[dict[GroupKey, int], dict[GroupKey, int]] = ({}, {})  # leases, pins
        for lease in self.leases.values():
            if (scope := scope_of(lease.holder_id)) is not None:
                scoped[(scope, lease.is_pin)] = scoped.get((scope, lease.is_pin), 0) + 1
                groups_so_far = scoped_groups.get((scope, lease.is_pin), 0)
                scoped_groups[(scope, lease.is_pin)] = groups_so_far + len(lease.groups)
            table = counts[lease.is_pin]
            for gid in lease.groups:
                table[gid] = table.get(gid, 0) + 1
        invariant(scoped == self._scope_held, "per-tenant lease counts differ from the leases held")
        invariant(scoped_groups == self._scope_groups, "per-tenant lease groups differ from the leases held")
        invariant(counts[0] == self.published.lease_count, "lease counts differ from the leases held")
        invariant(counts[1] == self.published.pin_count, "pin counts differ from the pins held")
        invariant(self.pins_held == sum(x.is_pin for x in self.leases.values()), "pins held drift")
        queued = set(self._heap)
        invariant(all((x.expires_ms, i) in queued for i, x in self.leases.items()), "a lease never expires")
        invariant(len(self._heap) <= 2 * len(self.leases) + HEAP_SLACK_MIN, "expiry heap over its bound")

"""The read leases the prefetch service holds for its hints, and when to renew them.

Synchronous and I/O-free: the prefetch shell tells it the leases a hint's lookup granted
(`keep`), asks which are due for a renewal (`due`, with the time and each hint's deadline),
sends one `lease_renew` per lease it names and reports the answer (`renewed` / `renew_failed`);
an ended hint's leases are taken out to be given back (`take`). Times are the wall clock in ms
(hint deadlines are wall clock, and so are the directory's lease expiries).

Why (known defect "Prefetch: leases of a hint are not renewed past 30 s"): a hint's lookup asks
for leases of `min(30 s, deadline - now)` and nothing renewed them, while the hint lived to its
deadline: a hint sent 2 minutes ahead had its sources unprotected for 90 s (evictable before they
were copied, then its copies failed), and the service still counted the leases as held and gave
them back at the end (`not_found`). Now each lease is renewed before it expires, for as long as
its hint's deadline is later than its expiry; the deadline itself is at most
`PrefetchConfig.hint_hold_ms_max` (5 min) after the hint arrived, so a hint's hold is bounded.

## One lease (shard, lease id), filed under the (tenant, hint id) whose lookup took it
    (none) --keep(expires_ms)--> HELD
    HELD --due: now >= expires - margin and the hint's deadline later than expires-->
        RENEWING [RenewLease(ttl = min(lease_ttl_ms, deadline - now))]; margin: `renew_margin_ms`,
        or a third of the TTL last granted if that is less (below)
    RENEWING --renewed(expires')--> HELD, its expiry the one asked for (or the directory's, if
        earlier); if the directory's answer leaves the expiry where its last answer put it (the
        directory does not extend a lease holding a lost group: it answers the lease's expiry
        as it was) it is FINAL: never renewed again (`lease_renew_refused_total`)
    RENEWING --renew_failed(lost=False: timeout, unavailable, ...)--> HELD, due again after
        `retry_ms` (`lease_renew_failed_total`)
    RENEWING --renew_failed(lost=True: `not_found`, the directory holds no such lease)--> (none)
    HELD --due at or after its expiry--> (none): lapsed, the directory dropped it
    HELD | RENEWING --take (its hint id ended)--> (none): the shell gives it back
A lease is FINAL only when the directory's own expiry did not move (review, stop 71): it was
when the expiry moved less than half of what was asked, but the directory caps each renewal at
its `KVF_DIRECTORY_LEASE_TTL_MS_MAX` (100 ms .. 600 s) while the shell asks 30 s, so under a
15 s cap a 2-minute hint's leases were final after one renewal and lost at 20 s; a directory
clock a third of a TTL behind did the same. A renewal asked only up to its hint's deadline
(less than `lease_ttl_ms`) that a directory whose clock is behind ours answers with an unmoved
expiry is no refusal either: the lease is held to its expiry (`up_to_deadline`), whose lapse
loses nothing, and renewed again if the deadline moves later. The TTL asked is cut to the
deadline when the renewal is sent (`sending`), not when it fell due: one that waited for its
shard's slots was granted past the deadline (review of the change). And the next renewal is due when a
third of the TTL granted is left, if that is less than `renew_margin_ms`: a 2 s cap renews about
every 1.3 s (a fixed 10 s margin made every lease due at once, then once per `retry_ms`, and a
cap of 1.5 s or less lapsed). The directory's first expiry is not known per lease (a lookup
reports the earliest of its shards'): the first answer is compared with that, so a lost group
may cost one renewal more before it is FINAL.

A lease dropped while its hint still wanted it (lost, or lapsed before its hint's deadline) is
counted in `leases_lost_total` and no longer listed as held (it was: the service believed it held
leases the directory had dropped, and released them at the hint's end for nothing). Its hint goes
on (its copies may still succeed; the sources are unprotected).

## Cost and bounds
A lease is renewed at most once per `lease_ttl_ms - renew_margin_ms` (20 s) of its hint's life
(or two thirds of the directory's cap, if it grants less), plus a retry per `retry_ms` (1 s)
within its last `renew_margin_ms` while renewals fail: at most about 15 renewals per lease for a
5-minute hint under a 30 s cap, and no more leases than the hints' lookups took
(one per shard per hint; the hints are bounded per tenant by the core). `due` costs O(log n) per
lease it looks at (a heap of check times, rebuilt past twice the leases held), never a walk of
them all: it runs after every tick of the service (20 ms). What `due` returns is sorted by shard,
so one round's renewals of a shard go out together (the wire has no batched renew: one
`lease_renew` each, the shell sending a bounded number at once).

## Invariants (`check_invariants`)
1. Every tracked lease is listed under the hint id it is filed under (`held`).
2. Every tracked lease not being renewed has a heap entry at its check time; the heap holds at
   most twice the tracked leases plus `HEAP_SLACK_MIN` entries.
3. No tracked lease is due after its expiry without a check: its check time is at most its expiry.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, TypeAlias

from kvfabric.format.invariant import invariant

__all__ = [
    "LEASE_COUNTERS",
    "HintLeases",
    "LeaseKeeping",
    "RenewLease",
]

Lease: TypeAlias = tuple[int, int]  # (shard, lease id): an id means something to its shard only
Named: TypeAlias = tuple[str, str]  # (tenant, hint id)

LEASE_COUNTERS: Final = (
    "lease_renewals_total",  # lease_renew requests sent (`sending`)
    "lease_renew_failed_total",  # answered by an error other than not_found: retried
    "lease_renew_refused_total",  # answered without the extension (a lost group): not renewed again
    "leases_lost_total",  # dropped while its hint still wanted it: not_found, or lapsed
)
HEAP_SLACK_MIN: Final = 64


@dataclass(frozen=True, slots=True)
class LeaseKeeping:
    lease_ttl_ms: int = 30_000  # a grant or renewal asks for at most this
    renew_margin_ms: int = 10_000  # renewed once it has this little left
    retry_ms: int = 1_000  # a failed renewal is tried again this much later (and a lease at its
    # hint's deadline is looked at again this often, in case its hint's deadline moved)

    def __post_init__(self) -> None:
        invariant(0 < self.renew_margin_ms < self.lease_ttl_ms, "need 0 < renew_margin_ms < lease_ttl_ms")
        invariant(0 < self.retry_ms <= self.renew_margin_ms, "need 0 < retry_ms <= renew_margin_ms")


@dataclass(frozen=True, slots=True)
class RenewLease:
    """Ask `shard` to renew `lease_id` for `ttl_ms`; then `renewed` or `renew_failed`."""

    named: Named
    shard: int
    lease_id: int
    ttl_ms: int

    @property
    def lease(self) -> Lease:
        return (self.shard, self.lease_id)


@dataclass(slots=True)
class _Kept:
    named: Named
    expires_ms: int  # our estimate: never later than the directory's
    check_ms: int  # when `due` looks at it next (while not renewing)
    margin_ms: int  # renewed once it has this little left: `renew_margin_ms`, or less (`_margin`)
    # the expiry the directory last answered (its clock), at first the lookup's: a renewal that
    # leaves it where it was was refused (a lost group)
    answered_ms: int
    renewing: bool = False
    asked_until_ms: int = 0  # while renewing: the expiry asked for
    asked_deadline_ms: int = 0  # while renewing: its hint's deadline (what the ask is cut to)
    asked_limited: bool = False  # the ask was cut to the deadline (less than `lease_ttl_ms`)
    final: bool = False  # a renewal was refused: held to its expiry, not renewed again
    # renewed up to its hint's deadline, as asked (a directory whose clock is behind ours may
    # answer no later expiry: no refusal, and its lapse there loses nothing); cleared if the
    # deadline moves later (review of the change, stop 71)
    up_to_deadline: bool = False


class HintLeases:
    """See the module docstring."""

    def __init__(self, config: LeaseKeeping | None = None) -> None:
        self.config = config or LeaseKeeping()
        # (tenant, hint id) -> its leases as granted (the shell's `_leases`: what it gives back)
        self.held: dict[Named, list[Lease]] = {}
        self._kept: dict[Lease, _Kept] = {}
        self._heap: list[tuple[int, Lease]] = []
        self.counters: dict[str, int] = dict.fromkeys(LEASE_COUNTERS, 0)

    @property
    def leases_held(self) -> int:
        return sum(len(leases) for leases in self.held.values())

    def expires_ms(self, lease: Lease) -> int | None:
        kept = self._kept.get(lease)
        return None if kept is None else kept.expires_ms

    # ---- events ----------------------------------------------------------------------------

    def keep(self, named: Named, leases: Iterable[Lease], expires_ms: int, now_ms: int) -> None:
        """`named`'s lookup granted `leases`, each valid until `expires_ms` at least (added to
        any it holds already: a hint id deduplicated into a live hint keeps its own too)."""
        margin = self._margin(expires_ms - now_ms)
        for lease in leases:
            self.held.setdefault(named, []).append(lease)
            if lease[1]:
                check_ms = min(expires_ms, max(now_ms, expires_ms - margin))
                kept = _Kept(named, expires_ms, check_ms, margin, expires_ms)
                self._kept[lease] = kept
                self._push(kept.check_ms, lease)

    def take(self, named: Named) -> list[Lease]:
        """The leases of `named` (its hint id ended), no longer tracked: to be given back."""
        leases = self.held.pop(named, [])
        for lease in leases:
            kept = self._kept.get(lease)
            if kept is not None and kept.named == named:
                del self._kept[lease]
        return leases

    def take_all(self) -> list[Lease]:
        return [lease for named in list(self.held) for lease in self.take(named)]

    def due(self, now_ms: int, deadline_of: Callable[[Named], int | None]) -> list[RenewLease]:
        """The renewals to send now, sorted by shard (each lease then RENEWING); leases found past
        their expiry are dropped. `deadline_of(named)`: the deadline of the live hint `named`
        belongs to (None: ended, its leases about to be taken)."""
        cfg = self.config
        out: list[RenewLease] = []
        while self._heap and self._heap[0][0] <= now_ms:
            check_ms, lease = heapq.heappop(self._heap)
            kept = self._kept.get(lease)
            if kept is None or kept.renewing or kept.check_ms != check_ms:
                continue  # stale entry
            deadline = deadline_of(kept.named)
            if now_ms >= kept.expires_ms:  # lapsed: the directory has dropped it
                needed = deadline is not None and deadline > kept.expires_ms and not kept.up_to_deadline
                self._drop(lease, kept, needed=needed)
                continue
            if kept.up_to_deadline and deadline is not None and deadline > kept.asked_deadline_ms:
                kept.final = kept.up_to_deadline = False  # its deadline moved later: renewed again
            if deadline is None or kept.final or deadline <= kept.expires_ms:
                # nothing to renew (now): looked at again at its expiry, or sooner in case its
                # hint's deadline moves (a hint id deduplicated into it)
                recheck = kept.expires_ms if kept.final else min(kept.expires_ms, now_ms + cfg.retry_ms)
                self._reschedule(lease, kept, recheck)
                continue
            if now_ms < kept.expires_ms - kept.margin_ms:  # its deadline moved: not due yet
                self._reschedule(lease, kept, kept.expires_ms - kept.margin_ms)
                continue
            ttl = min(cfg.lease_ttl_ms, deadline - now_ms)
            kept.renewing, kept.asked_until_ms, kept.asked_deadline_ms = True, now_ms + ttl, deadline
            kept.asked_limited = ttl < cfg.lease_ttl_ms
            out.append(RenewLease(kept.named, lease[0], lease[1], ttl))
        return sorted(out, key=lambda r: r.lease)

    def sending(self, renewal: RenewLease, now_ms: int | None = None) -> int:
        """The shell is about to send `renewal` at `now_ms`: the TTL to ask for, cut to its
        hint's deadline from now (a renewal that waited for its shard's slot asked the TTL
        computed when it was due, and was granted past the deadline; review of the change, stop
        71); 0 when not to send it: its lease was taken while it waited (its hint ended: given
        back, not renewed), or its deadline has come (held to its expiry). Counted here, when
        sent: counted in `due`, `lease_renewals_total` took in renewals never sent (an ended
        hint's, and those queued at `stop`; review, stop 71). `now_ms` None: as asked when due."""
        kept = self._kept.get(renewal.lease)
        if kept is None or not kept.renewing:
            return 0
        ttl = renewal.ttl_ms
        if now_ms is not None:
            ttl = min(self.config.lease_ttl_ms, kept.asked_deadline_ms - now_ms)
            if ttl <= 0:
                kept.renewing = False
                kept.final = kept.up_to_deadline = True
                self._reschedule(renewal.lease, kept, kept.expires_ms)
                return 0
            kept.asked_until_ms = now_ms + ttl
            kept.asked_limited = ttl < self.config.lease_ttl_ms
        self.counters["lease_renewals_total"] += 1
        return ttl

    def renewed(self, lease: Lease, expires_ms: int, now_ms: int) -> None:
        """The directory renewed `lease` until `expires_ms` (its reply; 0: not said)."""
        kept = self._kept.get(lease)
        if kept is None or not kept.renewing:
            return  # taken meanwhile (its hint ended): given back by the shell
        kept.renewing = False
        asked = kept.asked_until_ms
        new = min(asked, expires_ms) if expires_ms else asked
        if expires_ms and expires_ms <= kept.answered_ms:  # not extended
            # (compared with the directory's own last answer, not with what was asked: its cap
            # and its clock made an extension shorter than asked look refused; review, stop 71)
            kept.final = True
            if kept.asked_limited:  # asked only up to the deadline: a clock behind ours
                kept.up_to_deadline = True
            else:  # a lost group
                self.counters["lease_renew_refused_total"] += 1
        kept.answered_ms = max(kept.answered_ms, expires_ms)
        kept.expires_ms = max(kept.expires_ms, new)
        if kept.final:
            self._reschedule(lease, kept, kept.expires_ms)
        else:
            # From the TTL granted: at least two thirds of it pass before the next renewal, so
            # no floor of `retry_ms` (under a cap of 1.5 s or less that floor reached the expiry)
            kept.margin_ms = self._margin(kept.expires_ms - now_ms)
            after = max(kept.expires_ms - kept.margin_ms, now_ms)
            self._reschedule(lease, kept, min(kept.expires_ms, after))

    def renew_failed(self, lease: Lease, *, lost: bool, now_ms: int) -> None:
        """The renewal of `lease` failed: `lost` (`not_found`: the directory holds no such lease)
        drops it; any other error is retried after `retry_ms` (before its expiry)."""
        kept = self._kept.get(lease)
        if kept is None or not kept.renewing:
            return
        kept.renewing = False
        if lost:
            self._drop(lease, kept, needed=True)
            return
        self.counters["lease_renew_failed_total"] += 1
        self._reschedule(lease, kept, min(kept.expires_ms, now_ms + self.config.retry_ms))

    # ---- internals -------------------------------------------------------------------------

    def _margin(self, granted_ms: int) -> int:
        """How much of a lease granted for `granted_ms` is left when it is renewed:
        `renew_margin_ms`, or a third of it if less (a directory's shorter cap renews earlier)."""
        return max(1, min(self.config.renew_margin_ms, granted_ms // 3))

    def _drop(self, lease: Lease, kept: _Kept, *, needed: bool) -> None:
        del self._kept[lease]
        leases = self.held.get(kept.named, [])
        if lease in leases:
            leases.remove(lease)
        if not leases:
            self.held.pop(kept.named, None)
        if needed:
            self.counters["leases_lost_total"] += 1

    def _reschedule(self, lease: Lease, kept: _Kept, check_ms: int) -> None:
        kept.check_ms = check_ms
        self._push(check_ms, lease)

    def _push(self, check_ms: int, lease: Lease) -> None:
        heapq.heappush(self._heap, (check_ms, lease))
        if len(self._heap) > 2 * len(self._kept) + HEAP_SLACK_MIN:  # drop the stale entries
            self._heap = [(k.check_ms, lease) for lease, k in self._kept.items() if not k.renewing]
            heapq.heapify(self._heap)

    def check_invariants(self) -> None:
        for lease, kept in self._kept.items():
            invariant(lease in self.held.get(kept.named, []), "a tracked lease is not held", lease=lease)
            invariant(kept.check_ms <= kept.expires_ms, "a lease checked after its expiry", lease=lease)
        entries = set(self._heap)
        for lease, kept in self._kept.items():
            invariant(
                kept.renewing or (kept.check_ms, lease) in entries, "a lease never checked", lease=lease
            )
        invariant(len(self._heap) <= 2 * len(self._kept) + HEAP_SLACK_MIN, "lease heap unbounded")

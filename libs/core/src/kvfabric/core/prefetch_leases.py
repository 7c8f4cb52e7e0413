"""The read leases the prefetch service holds for its hints, and when to renew them.

Synchronous and I/O-free: the prefetch shell tells it the leases a hint's lookup granted
(`keep`), asks which renewals to start (`due`, with the time, each hint's deadline and how many
more each shard and this round may start), sends one `lease_renew` per lease it names and
reports the answer (`renewed` / `renew_failed`); an ended hint's leases are queued to be given
back (`give_back`), and the shell asks which releases to send (`releases`, bounded the same way)
and reports each answer (`release_done` / `release_failed`); it asks how many could start now
(`releases_ready`; when a release ends, whether one waits on its shard: `ready_on`) and when the
next retry is due (`next_release_retry_ms`) to start a round only when one can start something.
Times are the wall clock in ms (hint deadlines are wall clock, and so are the directory's lease
expiries).

Why (known defect "Prefetch: leases of a hint are not renewed past 30 s"): a hint's lookup asks
for leases of `min(30 s, deadline - now)` and nothing renewed them, while the hint lived to its
deadline: a hint sent 2 minutes ahead had its sources unprotected for 90 s (evictable before they
were copied, then its copies failed), and the service still counted the leases as held and gave
them back at the end (`not_found`). Now each lease is renewed before it expires, for as long as
its hint's deadline is later than its expiry; the deadline itself is at most
`PrefetchConfig.hint_hold_ms_max` (5 min) after the hint arrived, so a hint's hold is bounded.

## One lease (shard, lease id), filed under the (tenant, hint id) whose lookup took it
    (none) --keep(expires_ms)--> HELD
    HELD --now >= expires - margin and the hint's deadline later than expires--> DUE (queued on
        its shard, by expiry); margin: `renew_margin_ms`, or a third of the TTL last granted if
        that is less (below)
    DUE --started by `due` (its shard has room, the round has room, earliest expiry first)-->
        RENEWING [RenewLease(ttl = min(lease_ttl_ms, deadline - now))]
    DUE --its expiry passes first--> (none): lapsed, `lease_renewals_late_total` (a renewal
        that could not go in time) and `leases_lost_total`
    RENEWING --renewed(expires')--> HELD, its expiry the one asked for (or the directory's, if
        earlier); if the directory's answer leaves the expiry where its last answer put it (the
        directory does not extend a lease holding a lost group: it answers the lease's expiry
        as it was) it is FINAL: never renewed again (`lease_renew_refused_total`)
    RENEWING --renew_failed(lost=False: timeout, unavailable, ...)--> HELD, due again after
        `retry_ms` (`lease_renew_failed_total`); if the renewal was sent, the directory may
        have granted it: `maybe_until` := max(`maybe_until`, the expiry asked); not if
        `refused` (an error answered before any effect: bad_request, unauthorized, busy,
        rate_limited, quota_exceeded): not granted, the lease keeps its expiry and nothing more
    RENEWING --renew_failed(lost=True: `not_found`, the directory holds no such lease)--> (none)
    HELD --due at or after its expiry--> (none): lapsed; the directory dropped it, or, if
        `maybe_until` is later than now, may still hold it: its release is queued (below), held
        to `maybe_until`
    HELD | DUE | RENEWING --take / give_back (its hint id ended)--> (none) [give_back: released,
        held to the latest expiry the directory may hold it to: the later of its expiry,
        `maybe_until` and, for a RENEWING one whose renewal was sent, the one asked (its answer
        is then dropped)]
`maybe_until` (0: none) is the latest expiry the directory may hold a lease to that was never
confirmed: a renewal sent and answered by no reply (a timeout, a connection lost) may have been
granted, and the late side of the lookup's own grant (`keep`). It is never lowered (the
directory never shortens a lease, and a renewal timed out may still reach it later). A renewal
whose answer was lost went back to HELD with its old expiry and nothing else (review of the
change): its hint ending before a retry renewed it gave the lease back with the old expiry (a
release failing was given up there while the directory held the lease up to `lease_ttl_ms`
more), and a lease whose retries all failed was dropped as lapsed at the old expiry, never
released (pinned at the directory up to ~30 s).
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

## Renewals started per round (review of stop 71)
`due` started every renewal due at once, and the shell made a task for each, waiting for one of
its shard's 16 request slots: thousands due on one shard in one tick were thousands of tasks
created in that tick (the requests were bounded, the tasks and the tick's work were not). Now a
due lease is queued on its shard ordered by expiry, and `due(..., limit, shard_room)` starts at
most `limit` renewals in all and `shard_room(shard)` on each shard (the shell: its free request
slots there), earliest expiry first across shards; the rest stay DUE for the next round. A DUE
lease whose expiry passes before it could be started is dropped and counted in
`lease_renewals_late_total` (and `leases_lost_total` if its hint still wanted it).

## Releases of ended hints' leases (review of stop 71)
    (none) --give_back(named) / release(leases, expires) / a lapse with `maybe_until` later
        than now: id != 0, not expired, not already queued, the queue not full--> QUEUED (FIFO
        on its shard), with the latest expiry the directory may hold it to (ours, `maybe_until`
        or the one asked of a renewal in flight, above; `release`: the one given; unknown:
        now + `lease_ttl_ms`)
    (none) --give_back with `release_queue_max` releases queued--> not queued:
        `lease_releases_dropped_total`, the lease left to expire
    QUEUED --started by `releases` (shard and round room, first queued first)--> SENDING
        [ReleaseLease(attempt)]; its expiry passed first: dropped, `lease_releases_abandoned_total`
    SENDING --release_done (released, or `not_found`: already gone)--> (none)
    SENDING --release_failed (an error, or past the shell's deadline)--> WAITING until
        now + `retry_ms`, then QUEUED again (`lease_release_failed_total`); with
        `release_attempts_max` attempts spent or the retry at or past its expiry: (none),
        `lease_releases_abandoned_total`, left to expire
The shell sent them in batches of 16 awaited whole: one unanswered release held the 15 others of
its batch and every one queued behind, and a failed one was never retried (held to its TTL,
pinning space other tenants could use). Now each is sent on its own, at most `shard_room` per
shard at once, each with its own deadline in the shell. `release` queues the leases no hint
kept (a lookup's outside its hit, a hint that queued nothing, was busy or refused, or whose
dedupe found no live hint): the shell released those inline in the hint's reply path, one at a
time and never retried, one hung shard delaying the reply by its request timeout.
A lease taken while its renewal was in flight was given back with its old expiry (review of the
change): a renewal sent 0.5 s before it, granted to +30 s, and the hint ending before the answer
came queued nothing (the lease pinned at the directory ~30 s), and a release failing near the old
expiry was abandoned while the directory still held the lease.

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

Each round (`due`) looks at the leases whose check time came (each once per renewal period, as
before) and starts at most `limit`; the DUE queues hold at most the tracked leases (stale entries
compacted past twice them). Releases: at most `release_queue_max` queued, each sent at most
`release_attempts_max` times, never after its lease's expiry; `releases` starts at most `limit`.

## Invariants (`check_invariants`)
1. Every tracked lease is listed under the hint id it is filed under (`held`).
2. Every tracked lease neither DUE nor RENEWING has a heap entry at its check time, every DUE one
   an entry in its shard's queue at its expiry; the heap holds at most twice the tracked leases
   plus `HEAP_SLACK_MIN` entries, and so do the DUE queues.
3. No tracked lease is due after its expiry without a check: its check time is at most its expiry.
4. Every queued release is in exactly one of: its shard's FIFO, the retry heap, or SENDING; at
   most `release_queue_max` of them, none sent more than `release_attempts_max` times.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final, TypeAlias

from kvfabric.format.invariant import invariant

__all__ = [
    "LEASE_COUNTERS",
    "HintLeases",
    "LeaseKeeping",
    "ReleaseLease",
    "RenewLease",
]

Lease: TypeAlias = tuple[int, int]  # (shard, lease id): an id means something to its shard only
Named: TypeAlias = tuple[str, str]  # (tenant, hint id)

LEASE_COUNTERS: Final = (
    "lease_renewals_total",  # lease_renew requests sent (`sending`)
    "lease_renew_failed_total",  # answered by an error other than not_found: retried
    "lease_renew_refused_total",  # answered without the extension (a lost group): not renewed again
    "leases_lost_total",  # dropped while its hint still wanted it: not_found, or lapsed
    "lease_renewals_late_total",  # due, but not started before the lease expired (no room)
    "lease_release_failed_total",  # a release answered by an error or past its deadline: retried
    "lease_releases_abandoned_total",  # given up (attempts spent, or its lease expired): left to expire
    "lease_releases_dropped_total",  # not queued, the release queue full: left to expire
)
HEAP_SLACK_MIN: Final = 64


@dataclass(frozen=True, slots=True)
class LeaseKeeping:
    lease_ttl_ms: int = 30_000  # a grant or renewal asks for at most this
    renew_margin_ms: int = 10_000  # renewed once it has this little left
    retry_ms: int = 1_000  # a failed renewal or release is tried again this much later (and a
    # lease at its hint's deadline is looked at again this often, in case its deadline moved)
    release_attempts_max: int = 3  # a release is sent at most this many times
    release_queue_max: int = 4096  # releases queued (sending included); more are left to expire

    def __post_init__(self) -> None:
        invariant(0 < self.renew_margin_ms < self.lease_ttl_ms, "need 0 < renew_margin_ms < lease_ttl_ms")
        invariant(0 < self.retry_ms <= self.renew_margin_ms, "need 0 < retry_ms <= renew_margin_ms")
        invariant(self.release_attempts_max >= 1, "need release_attempts_max >= 1")
        invariant(self.release_queue_max >= 1, "need release_queue_max >= 1")


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


@dataclass(frozen=True, slots=True)
class ReleaseLease:
    """Ask `shard` to release `lease_id` (its `attempt`-th try); then `release_done` or
    `release_failed`."""

    shard: int
    lease_id: int
    attempt: int

    @property
    def lease(self) -> Lease:
        return (self.shard, self.lease_id)


@dataclass(slots=True)
class _Kept:
    named: Named
    expires_ms: int  # our estimate: never later than the directory's
    check_ms: int  # when `due` looks at it next (while neither queued nor renewing)
    margin_ms: int  # renewed once it has this little left: `renew_margin_ms`, or less (`_margin`)
    # the expiry the directory last answered (its clock), at first the lookup's: a renewal that
    # leaves it where it was was refused (a lost group)
    answered_ms: int
    renewing: bool = False
    queued: bool = False  # DUE: in its shard's queue, waiting for room to be started
    asked_until_ms: int = 0  # while renewing: the expiry asked for
    asked_deadline_ms: int = 0  # while renewing: its hint's deadline (what the ask is cut to)
    asked_limited: bool = False  # the ask was cut to the deadline (less than `lease_ttl_ms`)
    # while renewing: the renewal was sent (`sending`): the directory may have granted it, up to
    # `asked_until_ms`, whether or not its answer is ever told (`_take`)
    asked_sent: bool = False
    # the latest expiry the directory may hold it to, never confirmed (0: none): the one asked
    # by a sent renewal whose answer was lost, or the late side of the lookup's grant (`keep`);
    # never lowered. Given back with it (`_take`) and released at a lapse before it (`_look_at`)
    maybe_until_ms: int = 0
    final: bool = False  # a renewal was refused: held to its expiry, not renewed again
    # renewed up to its hint's deadline, as asked (a directory whose clock is behind ours may
    # answer no later expiry: no refusal, and its lapse there loses nothing); cleared if the
    # deadline moves later (review of the change, stop 71)
    up_to_deadline: bool = False


@dataclass(slots=True)
class _Release:
    expires_ms: int  # sending it after this is pointless: the directory has dropped the lease
    attempts: int = 0  # sent so far
    sending: bool = False
    retry_at_ms: int = 0  # > 0: waiting in the retry heap until then


class HintLeases:
    """See the module docstring."""

    def __init__(self, config: LeaseKeeping | None = None) -> None:
        self.config = config or LeaseKeeping()
        # (tenant, hint id) -> its leases as granted (the shell's `_leases`: what it gives back)
        self.held: dict[Named, list[Lease]] = {}
        self._kept: dict[Lease, _Kept] = {}
        self._heap: list[tuple[int, Lease]] = []
        # DUE leases, per shard a heap by expiry (stale entries: taken, or re-kept, meanwhile)
        self._queued: dict[int, list[tuple[int, Lease]]] = {}
        self._queued_entries = 0
        # releases to send: each lease's state; per shard a FIFO of (order, lease) ready to go;
        # those waiting to be retried, by when
        self._releases: dict[Lease, _Release] = {}
        self._ready: dict[int, deque[tuple[int, Lease]]] = {}
        self._retry: list[tuple[int, Lease]] = []
        self._order = itertools.count()
        self.counters: dict[str, int] = dict.fromkeys(LEASE_COUNTERS, 0)

    @property
    def leases_held(self) -> int:
        return sum(len(leases) for leases in self.held.values())

    @property
    def renewals_queued(self) -> int:
        """DUE leases: their renewal waits for room (their shard's, or the round's)."""
        return sum(1 for kept in self._kept.values() if kept.queued)

    @property
    def releases_pending(self) -> int:
        """Releases queued, waiting to be retried or being sent."""
        return len(self._releases)

    def expires_ms(self, lease: Lease) -> int | None:
        kept = self._kept.get(lease)
        return None if kept is None else kept.expires_ms

    # ---- events ----------------------------------------------------------------------------

    def keep(
        self,
        named: Named,
        leases: Iterable[Lease],
        expires_ms: int,
        now_ms: int,
        maybe_until_ms: int = 0,
    ) -> None:
        """`named`'s lookup granted `leases`, each valid until `expires_ms` at least (added to
        any it holds already: a hint id deduplicated into a live hint keeps its own too), and
        perhaps until `maybe_until_ms` at most (the late side: the lookup answered plus the TTL
        it asked; 0: `expires_ms`). Renewals go by the early side (renewed before the lease could
        have lapsed), its release by the late side (never given up while it may be live)."""
        margin = self._margin(expires_ms - now_ms)
        for lease in leases:
            self.held.setdefault(named, []).append(lease)
            if lease[1]:
                check_ms = min(expires_ms, max(now_ms, expires_ms - margin))
                kept = _Kept(named, expires_ms, check_ms, margin, expires_ms)
                kept.maybe_until_ms = max(maybe_until_ms, 0)
                self._kept[lease] = kept
                self._push(kept.check_ms, lease)

    def take(self, named: Named) -> list[Lease]:
        """The leases of `named` (its hint id ended), no longer tracked (nor given back: see
        `give_back`)."""
        return [lease for lease, _ in self._take(named)]

    def take_all(self) -> list[Lease]:
        return [lease for named in list(self.held) for lease in self.take(named)]

    def give_back(self, named: Named, now_ms: int) -> list[Lease]:
        """`named`'s hint id ended: its leases are no longer tracked and their releases are
        queued (`releases`); returns them. A lease without a tracked expiry is taken to last
        `lease_ttl_ms` from now (the most any grant asks); one already expired is not queued (a
        hint that ends at its deadline: its leases were renewed up to it, and end with it)."""
        taken = self._take(named)
        for lease, expires_ms in taken:
            self._queue_release(lease, expires_ms, now_ms)
        return [lease for lease, _ in taken]

    def release(self, leases: Iterable[Lease], expires_ms: int | None, now_ms: int) -> None:
        """Leases never kept (a lookup's that no hint holds: outside its hit, or of a hint that
        queued nothing, was not accepted or whose dedupe found no live hint) are given back like
        an ended hint's: queued (`releases`), each held until `expires_ms` (None: unknown, taken
        to last `lease_ttl_ms` from now). The shell released them inline, one at a time in the
        hint's reply path, never retried and outside the per-shard bound: one hung shard
        delayed the reply by a request timeout per lease (review of the change, stop 71)."""
        for lease in leases:
            self._queue_release(lease, expires_ms, now_ms)

    def give_back_all(self, now_ms: int) -> None:
        for named in list(self.held):
            self.give_back(named, now_ms)

    def due(
        self,
        now_ms: int,
        deadline_of: Callable[[Named], int | None],
        *,
        limit: int | None = None,
        shard_room: Callable[[int], int] | None = None,
    ) -> list[RenewLease]:
        """The renewals to start now, sorted by shard (each lease then RENEWING): at most `limit`
        in all and `shard_room(shard)` on a shard (None: no bound), earliest expiry first; the
        others due stay queued for a later round. Leases found past their expiry are dropped,
        their releases queued if the directory may still hold them (`maybe_until_ms`).
        `deadline_of(named)`: the deadline of the live hint `named` belongs to (None: ended, its
        leases about to be taken)."""
        while self._heap and self._heap[0][0] <= now_ms:  # due ones queued by expiry
            check_ms, lease = heapq.heappop(self._heap)
            kept = self._kept.get(lease)
            if kept is None or kept.renewing or kept.queued or kept.check_ms != check_ms:
                continue  # stale entry
            if self._look_at(lease, kept, now_ms, deadline_of(kept.named)) is not None:
                kept.queued = True
                heapq.heappush(self._queued.setdefault(lease[0], []), (kept.expires_ms, lease))
                self._queued_entries += 1
        for shard in list(self._queued):  # those that lapsed waiting, whether or not room is free
            queue = self._queued[shard]
            while queue and queue[0][0] <= now_ms:
                self._start_queued(queue, now_ms, deadline_of)
        out: list[RenewLease] = []
        room: dict[int, int | None] = {}
        heads: list[tuple[int, int]] = []
        for shard, queue in self._queued.items():
            room[shard] = None if shard_room is None else shard_room(shard)
            if queue and _has_room(room[shard]):
                heads.append((queue[0][0], shard))
        heapq.heapify(heads)
        while heads and (limit is None or len(out) < limit):
            _, shard = heapq.heappop(heads)
            queue = self._queued[shard]
            renewal = self._start_queued(queue, now_ms, deadline_of)
            if renewal is not None:
                out.append(renewal)
                room[shard] = _less(room[shard])
            if queue and _has_room(room[shard]):
                heapq.heappush(heads, (queue[0][0], shard))
        for shard in [s for s, queue in self._queued.items() if not queue]:
            del self._queued[shard]
        self._compact()
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
        kept.asked_sent = True
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

    def renew_failed(self, lease: Lease, *, lost: bool, now_ms: int, refused: bool = False) -> None:
        """The renewal of `lease` failed: `lost` (`not_found`: the directory holds no such lease)
        drops it; any other error is retried after `retry_ms` (before its expiry). Any other
        error of a renewal sent may have lost a grant (a timeout, a connection lost: the
        directory may have renewed it): the lease may be held up to the expiry asked
        (`maybe_until_ms`), where a release given up at its old expiry, or a lapse at it without
        one, left it pinned up to `lease_ttl_ms` more (review of the change). Not when `refused`:
        the directory answered an error that comes before any effect (the shell's
        `RENEW_REFUSALS`: bad_request, unauthorized, busy, rate_limited, quota_exceeded), so
        nothing was granted and the lease keeps its expiry alone (each was taken as maybe
        granted: an extra release at a lapse, or one held longer, answered `not_found`)."""
        kept = self._kept.get(lease)
        if kept is None or not kept.renewing:
            return
        kept.renewing = False
        if lost:
            self._drop(lease, kept, needed=True)
            return
        if kept.asked_sent and not refused:
            kept.maybe_until_ms = max(kept.maybe_until_ms, kept.asked_until_ms)
        self.counters["lease_renew_failed_total"] += 1
        self._reschedule(lease, kept, min(kept.expires_ms, now_ms + self.config.retry_ms))

    def releases(
        self, now_ms: int, *, limit: int | None = None, shard_room: Callable[[int], int] | None = None
    ) -> list[ReleaseLease]:
        """The releases to send now (each then SENDING, until `release_done` or
        `release_failed`): at most `limit` in all and `shard_room(shard)` on a shard (None: no
        bound), first queued first; the others wait for a later round. One whose lease has
        expired meanwhile is dropped (`lease_releases_abandoned_total`)."""
        self._requeue_retries(now_ms)
        room: dict[int, int | None] = {}
        heads: list[tuple[int, int]] = []
        for shard, ready in self._ready.items():
            room[shard] = None if shard_room is None else shard_room(shard)
            if ready and _has_room(room[shard]):
                heads.append((ready[0][0], shard))
        heapq.heapify(heads)
        out: list[ReleaseLease] = []
        while heads and (limit is None or len(out) < limit):
            _, shard = heapq.heappop(heads)
            ready = self._ready[shard]
            _, lease = ready.popleft()
            release = self._releases[lease]
            if now_ms >= release.expires_ms:  # nothing left to give back
                del self._releases[lease]
                self.counters["lease_releases_abandoned_total"] += 1
            else:
                release.sending = True
                release.attempts += 1
                out.append(ReleaseLease(lease[0], lease[1], release.attempts))
                room[shard] = _less(room[shard])
            if ready and _has_room(room[shard]):
                heapq.heappush(heads, (ready[0][0], shard))
        for shard in [s for s, ready in self._ready.items() if not ready]:
            del self._ready[shard]
        return out

    def releases_ready(
        self, now_ms: int, shard_room: Callable[[int], int] | None = None, *, at_most: int | None = None
    ) -> int:
        """How many releases `releases(now_ms, shard_room=...)` would start with no round limit,
        counted up to `at_most` (None: all): those queued on each shard (the retries due by
        `now_ms` queued again first, as `releases` does), at most `shard_room(shard)` there
        (None: no bound); one whose lease has expired meanwhile counts until a round drops it.
        The shell asks it after each round (a batch's worth, `at_most`: the walk stops there)
        and starts another round only when this is more than 0: those held back by their shard's
        room or a retry's wait started only at the next tick (up to `tick_ms`, 60 s; review of
        the change). When a release ends it asks `ready_on` its shard alone: this walk over every
        shard per release ended was quadratic (4,096 leases on as many shards: 2.8 s of CPU, the
        loop held 230 ms; review of the change)."""
        self._requeue_retries(now_ms)
        count = 0
        for shard, ready in self._ready.items():
            count += len(ready) if shard_room is None else min(len(ready), max(0, shard_room(shard)))
            if at_most is not None and count >= at_most:
                return at_most
        return count

    def ready_on(self, shard: int, now_ms: int) -> bool:
        """Whether a release is queued on `shard` (the retries due by `now_ms` queued again
        first): the shell asks it when a release there ends (its room freed), O(1) but for the
        retries it queues."""
        self._requeue_retries(now_ms)
        return bool(self._ready.get(shard))

    def next_release_retry_ms(self) -> int | None:
        """When the first release waiting to be retried (`release_failed`) comes due (None: none
        waits); the shell starts a round then."""
        return self._retry[0][0] if self._retry else None

    def release_done(self, lease: Lease) -> None:
        """`lease` was released (or the directory no longer held it: `not_found`)."""
        release = self._releases.get(lease)
        if release is not None and release.sending:
            del self._releases[lease]

    def release_failed(self, lease: Lease, now_ms: int) -> None:
        """The release of `lease` failed (an error, or no answer by the shell's deadline): sent
        again after `retry_ms` if it has attempts left and its lease lives past then; else given
        up, the lease left to expire."""
        release = self._releases.get(lease)
        if release is None or not release.sending:
            return
        release.sending = False
        self.counters["lease_release_failed_total"] += 1
        retry_at = now_ms + self.config.retry_ms
        if release.attempts >= self.config.release_attempts_max or retry_at >= release.expires_ms:
            del self._releases[lease]
            self.counters["lease_releases_abandoned_total"] += 1
            return
        release.retry_at_ms = retry_at
        heapq.heappush(self._retry, (retry_at, lease))

    # ---- internals -------------------------------------------------------------------------

    def _requeue_retries(self, now_ms: int) -> None:
        """The releases whose retry time came by `now_ms`: WAITING, then QUEUED again (last on
        their shard's queue)."""
        while self._retry and self._retry[0][0] <= now_ms:
            at_ms, lease = heapq.heappop(self._retry)
            release = self._releases.get(lease)
            if release is not None and release.retry_at_ms == at_ms:
                release.retry_at_ms = 0
                self._ready.setdefault(lease[0], deque()).append((next(self._order), lease))

    def _take(self, named: Named) -> list[tuple[Lease, int | None]]:
        """`named`'s leases, each with the latest expiry the directory may hold it to (None: not
        tracked), untracked. A lease whose renewal was sent and not yet answered may hold until
        the expiry asked: its answer, once it comes, is dropped (the lease no longer tracked), so
        taking its old expiry gave it back as expired (nothing queued: pinned at the directory up
        to `lease_ttl_ms` more), abandoned a failed release at the old expiry, and dropped a queued
        one there (review of the change, stop 71). So may one whose renewal's answer was lost
        (`maybe_until_ms`, review of the change)."""
        out: list[tuple[Lease, int | None]] = []
        for lease in self.held.pop(named, []):
            kept = self._kept.get(lease)
            if kept is not None and kept.named == named:
                del self._kept[lease]
                out.append((lease, self._may_last(kept)))
            else:
                out.append((lease, None))
        self._compact()
        return out

    @staticmethod
    def _may_last(kept: _Kept) -> int:
        """The latest expiry the directory may hold `kept` to: its own, `maybe_until_ms`, or the
        one asked by its renewal sent and not yet answered (the directory may have granted it)."""
        asked = kept.asked_until_ms if kept.renewing and kept.asked_sent else 0
        return max(kept.expires_ms, kept.maybe_until_ms, asked)

    def _queue_release(self, lease: Lease, expires_ms: int | None, now_ms: int) -> None:
        """Queue `lease`'s release, valid until `expires_ms` (None: `lease_ttl_ms` from now, the
        most any grant asks); not for lease id 0 (none granted) nor a lease expired already."""
        expires_ms = now_ms + self.config.lease_ttl_ms if expires_ms is None else expires_ms
        if not lease[1] or expires_ms <= now_ms:
            return  # nothing to give back
        if lease in self._releases:
            return  # queued already
        if len(self._releases) >= self.config.release_queue_max:
            self.counters["lease_releases_dropped_total"] += 1  # left to expire
            return
        self._releases[lease] = _Release(expires_ms)
        self._ready.setdefault(lease[0], deque()).append((next(self._order), lease))

    def _look_at(self, lease: Lease, kept: _Kept, now_ms: int, deadline: int | None) -> int | None:
        """A lease whose check time came (or DUE, now started): the TTL to renew it for, or None
        having dropped it (lapsed) or put it back in the heap (nothing to renew now)."""
        cfg = self.config
        if now_ms >= kept.expires_ms:  # lapsed: the directory has dropped it, or may not have
            needed = deadline is not None and deadline > kept.expires_ms and not kept.up_to_deadline
            if needed and kept.queued:  # due, but no room to start it before it expired
                self.counters["lease_renewals_late_total"] += 1
            self._drop(lease, kept, needed=needed)
            # a renewal whose answer was lost may have been granted: released, not left pinned
            # up to `lease_ttl_ms` at the directory (nothing if it cannot be live any more)
            self._queue_release(lease, self._may_last(kept), now_ms)
            return None
        kept.queued = False
        if kept.up_to_deadline and deadline is not None and deadline > kept.asked_deadline_ms:
            kept.final = kept.up_to_deadline = False  # its deadline moved later: renewed again
        if deadline is None or kept.final or deadline <= kept.expires_ms:
            # nothing to renew (now): looked at again at its expiry, or sooner in case its
            # hint's deadline moves (a hint id deduplicated into it)
            recheck = kept.expires_ms if kept.final else min(kept.expires_ms, now_ms + cfg.retry_ms)
            self._reschedule(lease, kept, recheck)
            return None
        if now_ms < kept.expires_ms - kept.margin_ms:  # its deadline moved: not due yet
            self._reschedule(lease, kept, kept.expires_ms - kept.margin_ms)
            return None
        return min(cfg.lease_ttl_ms, deadline - now_ms)

    def _start_queued(
        self, queue: list[tuple[int, Lease]], now_ms: int, deadline_of: Callable[[Named], int | None]
    ) -> RenewLease | None:
        """Pop the head of a shard's DUE queue: its renewal started, or None (a stale entry, a
        lease lapsed while it waited, or one with nothing to renew any more)."""
        expires_ms, lease = heapq.heappop(queue)
        self._queued_entries -= 1
        kept = self._kept.get(lease)
        if kept is None or not kept.queued or kept.expires_ms != expires_ms:
            return None  # stale entry
        deadline = deadline_of(kept.named)
        ttl = self._look_at(lease, kept, now_ms, deadline)
        if ttl is None:
            return None
        assert deadline is not None  # (a TTL is only given for a live hint's lease)
        kept.renewing, kept.asked_until_ms, kept.asked_deadline_ms = True, now_ms + ttl, deadline
        kept.asked_limited = ttl < self.config.lease_ttl_ms
        kept.asked_sent = False
        return RenewLease(kept.named, lease[0], lease[1], ttl)

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
            self._heap = [
                (k.check_ms, lease) for lease, k in self._kept.items() if not (k.renewing or k.queued)
            ]
            heapq.heapify(self._heap)

    def _compact(self) -> None:
        """Drop the stale entries of the heap and the DUE queues once they hold more than twice
        the tracked leases (plus `HEAP_SLACK_MIN`). Never while `due` walks the queues."""
        bound = 2 * len(self._kept) + HEAP_SLACK_MIN
        if len(self._heap) > bound:
            self._heap = [
                (k.check_ms, lease) for lease, k in self._kept.items() if not (k.renewing or k.queued)
            ]
            heapq.heapify(self._heap)
        if self._queued_entries > bound:
            self._queued = {}
            for lease, k in self._kept.items():
                if k.queued:
                    self._queued.setdefault(lease[0], []).append((k.expires_ms, lease))
            for queue in self._queued.values():
                heapq.heapify(queue)
            self._queued_entries = sum(len(queue) for queue in self._queued.values())

    def check_invariants(self) -> None:
        cfg = self.config
        for lease, kept in self._kept.items():
            invariant(lease in self.held.get(kept.named, []), "a tracked lease is not held", lease=lease)
            invariant(kept.check_ms <= kept.expires_ms, "a lease checked after its expiry", lease=lease)
            invariant(not (kept.renewing and kept.queued), "a lease both DUE and RENEWING", lease=lease)
        entries = set(self._heap)
        queued = {(expires, lease) for queue in self._queued.values() for expires, lease in queue}
        for lease, kept in self._kept.items():
            if kept.queued:
                invariant((kept.expires_ms, lease) in queued, "a DUE lease not queued", lease=lease)
            else:
                invariant(
                    kept.renewing or (kept.check_ms, lease) in entries, "a lease never checked", lease=lease
                )
        invariant(len(self._heap) <= 2 * len(self._kept) + HEAP_SLACK_MIN, "lease heap unbounded")
        invariant(
            self._queued_entries == sum(len(q) for q in self._queued.values())
            and self._queued_entries <= 2 * len(self._kept) + HEAP_SLACK_MIN,
            "DUE queues unbounded",
        )
        ready = [lease for queue in self._ready.values() for _, lease in queue]
        waiting = [lease for at_ms, lease in self._retry if self._releases[lease].retry_at_ms == at_ms]
        sending = [lease for lease, r in self._releases.items() if r.sending]
        invariant(
            sorted(ready + waiting + sending) == sorted(self._releases),
            "a release queued not exactly once",
        )
        invariant(len(self._releases) <= cfg.release_queue_max, "release queue unbounded")
        invariant(len(self._retry) == len(waiting), "a stale retry entry")
        for lease, release in self._releases.items():
            invariant(release.attempts <= cfg.release_attempts_max, "a release sent too often", lease=lease)


def _has_room(left: int | None) -> bool:
    return left is None or left > 0


def _less(left: int | None) -> int | None:
    return None if left is None else left - 1

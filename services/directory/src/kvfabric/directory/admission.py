"""Per-tenant fair admission in front of the directory's cores (issue 21 row 2): pure, called by
method (no `step`: see "Why methods" below).

No I/O, no event loop, no clock: time (`now_s`, seconds on any monotonic clock) is passed in.
The shell (`kvfabric.directory.fair`) asks it whether a tenant's request may wait for its turn,
which waiting requests start, and tells it when one is done.

A request costs `request_cost_ids + ids` tokens (`cost_of`): the ids it names (groups of a
lookup, keys of a put) plus a fixed part for what every request costs the event loop whatever
its size (receive, decode, reply). So with the default fixed part (16) a 4,096-id lookup costs
4,112 tokens and a 4-id one 20; a listing costs the groups it may examine (`fair_ids`).

States, per tenant (a tenant with nothing queued, nothing running, a bucket full by now and its
last request's `finish` not ahead of `vtime` holds no state: it is forgotten, and comes back as a
new one, with a full bucket and joining at `vtime` — what its bucket would hold and its tag would
be anyway, so forgetting forgives nothing. Only when `TENANTS_TRACKED_MAX` tenants are tracked
may an idle one be forgotten with its `finish` ahead of `vtime`: at most one request's ids
forgiven. Forgiving it in the sweep let a tenant that was idle two seconds start ahead of a head
tagged before its next request, 42 ids for a bound of 41, found by the Hypothesis machine):
- a token bucket (`kvfabric.core.quotas.TokenBucket`, the project's one): `tokens` in
  0..`burst_ids`, refilled at `ids_per_s`;
- a FIFO queue of admitted requests waiting for their turn (ticket, cost, since);
- `running`: its requests started and not yet done;
- `tag`: the virtual start time of its head request, and `finish`: the virtual time its last
  started request ends (`tag` + cost), in ids.
Globally: `vtime`, the tag of the request started last (never decreases), and `running`; two
heaps that keep every call's work independent of how many tenants are tracked: `_ready`, one
entry `(tag, head ticket, tenant)` per tenant that may start its head (stale entries are skipped
when popped, and the heap is rebuilt when over twice the tenants tracked), and `_idle`, one entry
`(when its bucket is full, tenant)` per tenant with nothing queued or running, swept at most
`FORGET_SWEEP_MAX` due entries per `offer` / `done` / `cancel` (each tenant going idle adds one:
the sweep keeps up). At most `TENANTS_TRACKED_MAX` tenants are tracked: a new one beyond it takes
the place of the idle tenant whose bucket fills first (forgiving it the rest of its refill), or
is refused `Refusal.QUEUE` when none is idle.

The turns are start-time fair queueing (Goyal, Vin and Cheng, 1996), the virtual-time form of
weighted round robin by ids: a tenant's head request is tagged `max(finish, vtime)` when it
becomes the head, and of the tenants that may start one (fewer than `tenant_running_max` of
theirs run) the smallest tag starts first (ties: the older ticket). A tenant that was idle joins
at `vtime` (no credit saved up while idle); one that took much recently waits until the others
have had as many ids. Deficit round robin was the first choice; with one request of a tenant
running at a time it serves one request per tenant per round, whatever its size: a 16-id
tenant got 6,080 ids while a 1,024-id one got 20,480 (`test_turns_share_ids_not_requests`).

Transitions:
- `offer(tenant, cost, now)`: refused with `Refusal.QUEUE` when the tenant already has
  `queue_max` requests waiting, with `Refusal.RATE` when its bucket holds fewer than `cost`
  tokens (a cost above `burst_ids` counts as `burst_ids`, as `quotas.request_tokens` does);
  otherwise the tokens are taken and the request queued. A refusal takes nothing.
- `refuse_early(tenant, now)`: what `offer` would refuse whatever the cost (before decoding).
- `charge_more(tenant, ids, now)`: a running request cost more than its admission (a lookup's
  replicas past one per group): taken from the bucket, into at most one burst of debt.
- `suspend(tenant, now, for_s)`: its bucket emptied (a debt stays) and refilling nothing for
  `for_s` (the tenant was tarpitted for that long: it banks no budget meanwhile).
- `start(now)`: while fewer than `running_max` run, the smallest-tagged head that may start
  starts (popped from `_ready`); `vtime` becomes its tag.
- `done(tenant)`: one of its started requests ended (answered, failed or cancelled).
- `cancel(ticket)`: a queued request given up before it started (its tokens are not returned).

Invariants (`check`): a tenant's queue holds at most `queue_max`; `0 <= tokens <= burst_ids`;
at most `running_max` requests run, at most `tenant_running_max` of one tenant; `vtime` never
decreases; a queued head's tag is at least its tenant's `finish`; every tenant that may start its
head has its current `(tag, head ticket)` in `_ready`; every idle tenant is in `_idle`; at most
`TENANTS_TRACKED_MAX` tenants are tracked and `_ready` holds at most twice as many entries + 64.
Guarantees, for the shell: a tenant's admitted ids over any interval of length T are at most
`burst_ids + ids_per_s * T`; after `start` no request waits while a slot it could take is free
(work conserving); one tenant's requests start in the order they were offered; while a
tenant's head waits able to start, another tenant starts at most (that head's tag − its own
head's tag) + one request's ids before it — for a tenant that was idle, one request of each
other tenant whose tags are not behind: one tenant's backlog delays another's request by one of
its requests, never by the backlog's length. What one started request then costs the event loop
is the shell's (a lookup folds 128 groups a core call, yielding between: one slice).

## Why methods, not `step(event, now_ms)`
Unlike the protocol cores (`kvfabric.core.step.Core`), `FairAdmission` and `GivebackBudget` are
called by their one shell, `FairGate` (`fair.py`), method by method, with `now_s` (float seconds
of the gate's clock, a fake one in tests) — like the segment's and client's tables
(docs/architecture.md, the shells table): a tenant's request offers, and on a refusal reads
`retry_after_s` for its `Busy`, in one synchronous call on the directory's event loop with no
await between; `start`'s `Started` are woken by the gate in the same call, and `done` is called
from the request's `finally`. The answers are the whole output (there are no effects to
perform), and `CoreDriver.feed` would put an await and a lock in front of every tenant request.
It lives in the directory service, beside its one shell, though it imports only
`kvfabric.core.quotas` and `kvfabric.format.invariant`: moving it into `libs/core` is a rename
not done.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from kvfabric.core.quotas import TokenBucket
from kvfabric.format.invariant import invariant

__all__ = [
    "AdmissionConfig",
    "FairAdmission",
    "GivebackBudget",
    "Refusal",
    "Started",
    "TenantStats",
    "cost_of",
]

COUNTED_TENANTS_MAX: Final = 10_000  # refusal counts kept (least recently refused go first)
TENANTS_TRACKED_MAX: Final = 65_536  # tenants with state (queued, running or refilling), tenants
FORGET_SWEEP_MAX: Final = 16  # idle tenants examined for forgetting per offer / done / cancel
READY_SLACK: Final = 64  # `_ready` is rebuilt when over 2 x tenants tracked + this, entries


def cost_of(ids: int, request_cost_ids: int) -> int:
    """Tokens a request naming `ids` ids costs: its ids plus the fixed part every request costs."""
    invariant(ids >= 0 and request_cost_ids >= 0, "negative cost", ids=ids, fixed=request_cost_ids)
    return request_cost_ids + ids


class Refusal(enum.StrEnum):
    """Why `offer` refused (a label of `kvfabric_directory_fair_refused_total`)."""

    RATE = "rate"  # the tenant's token bucket holds less than the request's cost
    QUEUE = "queue"  # the tenant already has `queue_max` requests waiting


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionConfig:
    ids_per_s: float  # each tenant's bucket refill, tokens (ids) a second
    burst_ids: int  # each tenant's bucket capacity, tokens
    queue_max: int  # requests one tenant may have waiting for a turn
    running_max: int  # requests started and not done, all tenants
    tenant_running_max: int  # of one tenant
    request_cost_ids: int = 0  # the fixed part of every request's cost (`cost_of`)
    # Give-backs are never queued nor charged above; only the ids of theirs that gave nothing
    # back are, from a separate per-tenant bucket (`GivebackBudget`): refill ids/s and capacity.
    giveback_empty_ids_per_s: float = 16_384.0
    giveback_empty_burst_ids: int = 65_536

    def __post_init__(self) -> None:
        invariant(self.ids_per_s > 0, "ids_per_s must be > 0", ids_per_s=self.ids_per_s)
        invariant(self.burst_ids >= 1, "burst_ids must be >= 1", burst_ids=self.burst_ids)
        invariant(self.queue_max >= 1, "queue_max must be >= 1", queue_max=self.queue_max)
        invariant(
            1 <= self.tenant_running_max <= self.running_max,
            "need 1 <= tenant_running_max <= running_max",
            tenant_running_max=self.tenant_running_max,
            running_max=self.running_max,
        )
        invariant(self.request_cost_ids >= 0, "request_cost_ids must be >= 0")
        invariant(self.giveback_empty_ids_per_s > 0, "giveback_empty_ids_per_s must be > 0")
        invariant(self.giveback_empty_burst_ids >= 1, "giveback_empty_burst_ids must be >= 1")


@dataclass(frozen=True, slots=True)
class Started:
    """A request `start` let run: the shell wakes its waiter."""

    ticket: int
    tenant: str
    waited_s: float


@dataclass(slots=True)
class _Waiting:
    ticket: int
    cost: int
    since_s: float


@dataclass(slots=True)
class _Tenant:
    bucket: TokenBucket
    queue: deque[_Waiting] = field(default_factory=deque)
    running: int = 0
    tag: int = 0  # virtual start of the head request (meaningful while the queue is not empty)
    finish: int = 0  # virtual end of the last started request
    ready_key: tuple[int, int] | None = None  # (tag, head ticket) of its newest `_ready` entry
    idle_queued: bool = False  # has an entry in `_idle`


@dataclass(slots=True)
class TenantStats:
    """Refusals by reason, for metrics (kept after the tenant's state is forgotten)."""

    rate: int = 0
    queue: int = 0


class FairAdmission:
    """See the module docstring."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._tenants: dict[str, _Tenant] = {}
        self.vtime = 0
        self._tickets: dict[int, str] = {}  # queued ticket -> its tenant
        self._next_ticket = 1
        self.running = 0
        self.refused: dict[str, TenantStats] = {}
        self.admitted_total = 0
        self.charged_after_total = 0  # ids taken by `charge_more` (answers costlier than named)
        self.suspended_total = 0  # tarpits that suspended a tenant's bucket (`suspend`)
        self.longest_wait_s = 0.0  # of the requests started since `take_longest_wait`
        self._ready: list[tuple[int, int, str]] = []  # (tag, head ticket, tenant): may start
        self._idle: list[
            tuple[float, str]
        ] = []  # (when its bucket is full, tenant): nothing queued or running
        self.examined_total = 0  # heap entries popped by start and the sweep (the work, for tests)

    @property
    def tracked(self) -> int:
        """Tenants holding state (queued, running, or with a bucket still refilling)."""
        return len(self._tenants)

    # ---- read-only views ---------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests waiting for their turn, all tenants."""
        return len(self._tickets)

    def queue_depth(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return len(state.queue) if state is not None else 0

    def running_of(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.running if state is not None else 0

    def tokens(self, tenant: str, now_s: float) -> float:
        state = self._tenants.get(tenant)
        return state.bucket.level(now_s) if state is not None else float(self.config.burst_ids)

    def head_tag(self, tenant: str) -> int | None:
        """The virtual start of `tenant`'s head request; None when nothing is queued."""
        state = self._tenants.get(tenant)
        return state.tag if state is not None and state.queue else None

    def oldest_wait_s(self, now_s: float) -> float:
        """How long the longest-waiting queued request has waited so far. Also read by the
        metrics thread (`take_longest_wait`) while the loop adds, drops and serves tenants: the
        tenants are copied whole first (`dict()`, one C call), and a queue emptied meanwhile is
        skipped (docs/metrics.md)."""
        heads = []
        for state in dict(self._tenants).values():
            try:
                heads.append(state.queue[0].since_s)
            except IndexError:  # nothing queued (or served since the copy)
                continue
        return max(0.0, now_s - min(heads)) if heads else 0.0

    def take_longest_wait(self, now_s: float) -> float:
        """The longest wait of a request started since the last call, or of one still waiting
        (a metric read at scrape time, then reset)."""
        longest = max(self.longest_wait_s, self.oldest_wait_s(now_s))
        self.longest_wait_s = 0.0
        return longest

    def retry_after_s(self, tenant: str, cost: int, now_s: float) -> float:
        """How long until the tenant's bucket holds `cost` tokens (0 when it does; a suspended
        bucket's suspension included)."""
        state = self._tenants.get(tenant)
        if state is None:
            return 0.0  # a full bucket holds any cost (one above the burst counts as the burst)
        return state.bucket.wait_s(min(cost, self.config.burst_ids), now_s)

    # ---- transitions -------------------------------------------------------------------------

    def offer(self, tenant: str, cost: int, now_s: float) -> int | Refusal:
        """Queue a request of `cost` tokens for a turn: its ticket, or why it was refused."""
        invariant(cost >= 0, "negative cost", cost=cost)
        c = self.config
        cost = min(cost, c.burst_ids)
        self._sweep(now_s)
        state = self._tenants.get(tenant)
        if state is None:
            if len(self._tenants) >= TENANTS_TRACKED_MAX and not self._forget_soonest():
                return self._refuse(tenant, Refusal.QUEUE)  # every tracked tenant is busy
            state = self._tenants[tenant] = _Tenant(TokenBucket.full(c.ids_per_s, c.burst_ids, now_s))
        if len(state.queue) >= c.queue_max:
            return self._refuse(tenant, Refusal.QUEUE)
        if not state.bucket.take(cost, now_s):
            return self._refuse(tenant, Refusal.RATE)  # idle (in `_idle`) or busy: unchanged
        ticket = self._next_ticket
        self._next_ticket += 1
        if not state.queue:
            state.tag = max(state.finish, self.vtime)  # idle: joins now, no credit saved up
        state.queue.append(_Waiting(ticket, cost, now_s))
        self._tickets[ticket] = tenant
        self.admitted_total += 1
        self._push_ready(tenant, state)
        return ticket

    def charge_more(self, tenant: str, ids: int, now_s: float) -> None:
        """A running request of `tenant` turned out to cost `ids` more than it was admitted for
        (`shard_requests.reply_extra_ids`): taken from its bucket, into debt of at most one
        burst (its next requests wait for the refill). Called before `done`, so the tenant's
        idle entry is pushed with the bucket as it is after."""
        state = self._tenants.get(tenant)
        if state is None or ids <= 0:
            return
        before = state.bucket.level(now_s)
        state.bucket.charge(ids, now_s, floor=-float(self.config.burst_ids))
        self.charged_after_total += round(before - state.bucket.level(now_s))  # what was taken

    def refuse_early(self, tenant: str, now_s: float) -> Refusal | None:
        """What `offer` would refuse whatever the request's size (its queue is full, or its
        bucket holds less than the fixed part of a cost), counted as a refusal; None when a
        request of the smallest cost would be queued. Lets the shell refuse before decoding."""
        state = self._tenants.get(tenant)
        if state is None:
            return None
        if len(state.queue) >= self.config.queue_max:
            return self._refuse(tenant, Refusal.QUEUE)
        if state.bucket.level(now_s) < max(1, self.config.request_cost_ids):
            return self._refuse(tenant, Refusal.RATE)
        return None

    def suspend(self, tenant: str, now_s: float, for_s: float) -> None:
        """`tenant`'s bucket emptied, refilling nothing for `for_s`: a tenant tarpitted for that
        long (`kvfabric.runtime.tarpit`) banks no budget while its requests go unread, so it
        comes back with none rather than a burst of its largest requests (docs/security.md
        "The tarpit"). A tenant with no state gets one (a full bucket, then suspended), unless
        every tracked tenant is busy (the bound: `offer` refuses it then anyway). At that bound
        an idle suspended tenant may be forgotten for a new one (`_forget_soonest`), its
        suspension forgiven with it, as any idle tenant's refill is."""
        if for_s <= 0:
            return
        state = self._tenants.get(tenant)
        if state is None:
            if len(self._tenants) >= TENANTS_TRACKED_MAX and not self._forget_soonest():
                return
            c = self.config
            state = self._tenants[tenant] = _Tenant(TokenBucket.full(c.ids_per_s, c.burst_ids, now_s))
        state.bucket.suspend(now_s, now_s + for_s)
        self.suspended_total += 1
        self._went_idle(tenant, state, now_s)  # an idle one's older `_idle` entry is re-timed when popped

    def start(self, now_s: float) -> list[Started]:
        """The queued requests that may run now, smallest tag first (module docstring)."""
        c = self.config
        started: list[Started] = []
        # Each pass pops one entry of `_ready` (stale ones skipped) and starts at most one
        # request: bounded by the heap's size and `running_max`.
        while self.running < c.running_max and self._ready:
            tag, ticket, tenant = heapq.heappop(self._ready)
            self.examined_total += 1
            state = self._tenants.get(tenant)
            if state is None or state.ready_key != (tag, ticket):
                continue  # stale: its tenant's head or tag changed since (or it was forgotten)
            state.ready_key = None
            if not state.queue or state.running >= c.tenant_running_max:
                continue  # pushed again when it may start (`_push_ready`)
            waiting = state.queue.popleft()
            invariant(waiting.ticket == ticket and state.tag == tag, "ready entry out of date", tenant=tenant)
            del self._tickets[waiting.ticket]
            self.vtime = max(self.vtime, tag)
            state.finish = tag + waiting.cost
            state.tag = state.finish  # the next head follows on
            state.running += 1
            self.running += 1
            waited_s = max(0.0, now_s - waiting.since_s)
            self.longest_wait_s = max(self.longest_wait_s, waited_s)
            started.append(Started(waiting.ticket, tenant, waited_s))
            self._push_ready(tenant, state)
        return started

    def done(self, tenant: str, now_s: float) -> None:
        """One of `tenant`'s started requests ended."""
        state = self._tenants.get(tenant)
        invariant(state is not None and state.running > 0, "done without a start", tenant=tenant)
        assert state is not None
        state.running -= 1
        self.running -= 1
        self._push_ready(tenant, state)
        self._went_idle(tenant, state, now_s)
        self._sweep(now_s)

    def cancel(self, ticket: int, now_s: float) -> bool:
        """Drop a queued request that will not run (its waiter went away). False when it is not
        queued (it started meanwhile: the caller then owes a `done`)."""
        tenant = self._tickets.pop(ticket, None)
        if tenant is None:
            return False
        state = self._tenants[tenant]
        state.queue = deque(w for w in state.queue if w.ticket != ticket)
        self._push_ready(tenant, state)
        self._went_idle(tenant, state, now_s)
        self._sweep(now_s)
        return True

    # ---- internals ---------------------------------------------------------------------------

    def _refuse(self, tenant: str, why: Refusal) -> Refusal:
        stats = self.refused.pop(tenant, None) or TenantStats()
        self.refused[tenant] = stats  # most recently refused last
        if why is Refusal.RATE:
            stats.rate += 1
        else:
            stats.queue += 1
        if len(self.refused) > COUNTED_TENANTS_MAX:
            del self.refused[next(iter(self.refused))]
        return why

    def _push_ready(self, tenant: str, state: _Tenant) -> None:
        """`tenant`'s head into `_ready` when it may start and its entry there is not current."""
        if not state.queue or state.running >= self.config.tenant_running_max:
            return
        key = (state.tag, state.queue[0].ticket)
        if state.ready_key == key:
            return
        state.ready_key = key
        heapq.heappush(self._ready, (key[0], key[1], tenant))
        if len(self._ready) > 2 * len(self._tenants) + READY_SLACK:  # stale entries: rebuild (amortized)
            self._ready = [
                (t.ready_key[0], t.ready_key[1], name)
                for name, t in self._tenants.items()
                if t.ready_key is not None
            ]
            heapq.heapify(self._ready)

    def _went_idle(self, tenant: str, state: _Tenant, now_s: float) -> None:
        """A tenant with nothing queued or running goes into `_idle` (once)."""
        if state.queue or state.running or state.idle_queued:
            return
        state.bucket.refill(now_s)
        state.idle_queued = True
        heapq.heappush(self._idle, (state.bucket.full_at_s(), tenant))

    def _sweep(self, now_s: float) -> None:
        """Forget at most `FORGET_SWEEP_MAX` idle tenants whose bucket is full by now."""
        for _ in range(FORGET_SWEEP_MAX):
            if not self._idle or self._idle[0][0] > now_s:
                return
            self._pop_idle(now_s)

    def _forget_soonest(self) -> bool:
        """Make room for a new tenant: forget the idle one whose bucket fills first (its state is
        then that of a tenant with a full bucket: a little refill forgiven). False: none idle."""
        while self._idle:
            if self._pop_idle(None):
                return True
        return False

    def _pop_idle(self, now_s: float | None) -> bool:
        """Pop `_idle`'s first entry: forget its tenant if still idle (full by `now_s` and its
        `finish` not ahead of `vtime`, or at once when None), or put it back under its new time.
        True when a tenant was forgotten."""
        _, tenant = heapq.heappop(self._idle)
        self.examined_total += 1
        state = self._tenants.get(tenant)
        if state is None:
            return False
        state.idle_queued = False
        if state.queue or state.running:
            return False  # busy again: back into `_idle` when it is done (`_went_idle`)
        actual_s = state.bucket.full_at_s()  # its tokens only refill while it is idle
        if now_s is not None and actual_s > now_s:  # went busy and idle again since the entry
            state.idle_queued = True
            heapq.heappush(self._idle, (actual_s, tenant))
            return False
        if now_s is not None and state.finish > self.vtime:
            # Its next request's tag would still be `finish`, not `vtime`: forgetting it now would
            # let it start ahead of heads tagged before that. Looked at again a refill later.
            state.idle_queued = True
            later_s = now_s + self.config.burst_ids / self.config.ids_per_s
            heapq.heappush(self._idle, (later_s, tenant))
            return False
        del self._tenants[tenant]
        return True

    def check(self) -> None:
        """Assert the invariants of the module docstring (tests; cheap enough for debugging)."""
        c = self.config
        invariant(0 <= self.running <= c.running_max, "running out of bounds", running=self.running)
        invariant(sum(s.running for s in self._tenants.values()) == self.running, "running miscounted")
        invariant(sum(len(s.queue) for s in self._tenants.values()) == len(self._tickets), "tickets lost")
        for tenant, s in self._tenants.items():
            invariant(len(s.queue) <= c.queue_max, "queue over its bound", tenant=tenant)
            invariant(0 <= s.running <= c.tenant_running_max, "tenant running over its bound", tenant=tenant)
            s.bucket.check(floor=-float(c.burst_ids))  # `charge_more` may leave one burst of debt
            invariant(not s.queue or s.tag >= s.finish, "a head tagged before its tenant's last end")
            may_start = bool(s.queue) and s.running < c.tenant_running_max
            invariant(
                not may_start or s.ready_key == (s.tag, s.queue[0].ticket), "a startable head not ready"
            )
            invariant(s.queue or s.running or s.idle_queued, "an idle tenant not in _idle", tenant=tenant)
        invariant(len(self._tenants) <= TENANTS_TRACKED_MAX, "tenants over their bound")
        invariant(len(self._ready) <= 2 * len(self._tenants) + READY_SLACK + 1, "_ready over its bound")
        live = {(tag, ticket, name) for tag, ticket, name in self._ready}
        for name, s in self._tenants.items():
            if s.ready_key is not None and s.queue and s.running < c.tenant_running_max:
                invariant((*s.ready_key, name) in live, "a ready key missing from _ready", tenant=name)


class GivebackBudget:
    """Per tenant, the ids of its give-backs (lease release, unpin, put abort, lease_release_many)
    that gave nothing back: a token bucket (`TokenBucket`) of `giveback_empty_ids_per_s`,
    capacity `giveback_empty_burst_ids`, charged after the core answered (`charge(named -
    released)`), never for an id that released something. Pure: time passed in.

    A charge may leave a debt: the bucket goes down to `-burst_ids`, not to 0. Without the debt
    a tenant was `spent` (fewer than one token) only until one token refilled — 61 µs at the
    default 16,384 ids/s — so its next 4,096-key give-back of nothing, a millisecond later, ran
    whole again: the budget bounded nothing at that rate. With it, a tenant that named
    `burst + n` ids of nothing is spent for `n / ids_per_s`.

    States, per tenant: `bucket` in -burst..burst; `refusing`: spent, and the last give-back it
    tried while spent (one slice, `kvfabric.directory.giveback`) released nothing. A tenant whose
    bucket is full and that is not refusing holds no state (forgotten when seen so); at most
    `TENANTS_TRACKED_MAX` tenants (beyond it the least recently charged is forgotten: its bucket
    is full again).
    Transitions: `charge` (after the core answered); `tried_spent(released)` (a spent slice's
    outcome: refusing when it released nothing, not when it did); refilling to one token ends
    `refusing` (`refuses`).
    The shell: `refuses(tenant)` is checked before a give-back is decoded (a refusing tenant's
    give-back is `busy` then, costing its receive alone); a spent tenant that is not refusing
    has its give-back run one slice first, `busy` when that slice released nothing (then it is
    refusing). So a tenant flooding give-backs of nothing costs, once spent, one slice per
    refill of a token and a receive per request; a tenant that is spent but gives back is never
    refused (its slices release: it never becomes `refusing`).
    Invariants: `-burst <= tokens <= burst`; `refusing` only for a tracked tenant;
    `len(tenants) <= TENANTS_TRACKED_MAX`."""

    def __init__(self, ids_per_s: float, burst_ids: int) -> None:
        invariant(ids_per_s > 0 and burst_ids >= 1, "bad give-back budget", ids_per_s=ids_per_s)
        self.ids_per_s = ids_per_s
        self.burst_ids = burst_ids
        self._tenants: dict[str, TokenBucket] = {}  # least recently charged first
        self._refusing: set[str] = set()
        self.refused_total = 0  # give-backs of nothing refused while spent (after a slice)
        self.refused_early_total = 0  # give-backs of a refusing tenant refused before decoding
        self.empty_ids_total = 0  # ids charged

    @property
    def floor(self) -> float:
        """The deepest debt a charge leaves (class docstring)."""
        return -float(self.burst_ids)

    def tokens(self, tenant: str, now_s: float) -> float:
        bucket = self._tenants.get(tenant)
        return float(self.burst_ids) if bucket is None else bucket.level(now_s)

    def spent(self, tenant: str, now_s: float) -> bool:
        """Fewer than one token: the tenant's next give-back is tried one slice first."""
        tokens = self.tokens(tenant, now_s)
        if tokens >= self.burst_ids and tenant not in self._refusing:
            self._tenants.pop(tenant, None)  # full: the same as no state
        return tokens < 1

    def refuses(self, tenant: str, now_s: float) -> bool:
        """Whether `tenant`'s next give-back is refused before it is decoded: it is spent and the
        last slice it tried while spent released nothing (class docstring)."""
        if tenant not in self._refusing:
            return False
        if not self.spent(tenant, now_s):
            self._refusing.discard(tenant)  # a token refilled: its next give-back is tried again
            return False
        self.refused_early_total += 1
        return True

    def tried_spent(self, tenant: str, released: bool) -> None:
        """A slice of `tenant`'s, tried while it was spent, released something or nothing."""
        if released:
            self._refusing.discard(tenant)
        elif tenant in self._tenants:
            self._refusing.add(tenant)

    def charge(self, tenant: str, empty_ids: int, now_s: float) -> None:
        """`empty_ids` ids of a give-back of `tenant`'s released nothing."""
        invariant(empty_ids >= 0, "negative charge", empty_ids=empty_ids)
        if empty_ids == 0:
            return
        self.empty_ids_total += empty_ids
        bucket = self._tenants.pop(tenant, None) or TokenBucket.full(self.ids_per_s, self.burst_ids, now_s)
        bucket.charge(empty_ids, now_s, floor=self.floor)
        self._tenants[tenant] = bucket  # most recently charged last
        if len(self._tenants) > TENANTS_TRACKED_MAX:
            forgotten = next(iter(self._tenants))
            del self._tenants[forgotten]
            self._refusing.discard(forgotten)

    def retry_after_s(self, tenant: str, now_s: float) -> float:
        """How long until the tenant's bucket holds one token again."""
        bucket = self._tenants.get(tenant)
        return 0.0 if bucket is None else bucket.wait_s(1.0, now_s)

    def check(self) -> None:
        invariant(len(self._tenants) <= TENANTS_TRACKED_MAX, "give-back tenants over their bound")
        invariant(self._refusing <= self._tenants.keys(), "a refusing tenant not tracked")
        for bucket in self._tenants.values():
            bucket.check(floor=self.floor)

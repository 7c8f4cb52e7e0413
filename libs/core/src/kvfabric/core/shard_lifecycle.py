"""The shard lifecycle of one directory instance: what it does about the shards it leads.

Synchronous and I/O-free, one entry: `step(event, now_ms) -> list[Effect]`; time is passed in
(the instance's monotonic clock, in ms) and the core never reads a clock, sleeps or does I/O.

`ShardLeadership` (`kvfabric.core.leadership`) decides *which* shards this instance leads and
under which epoch (leases in JetStream KV, driven by `kvfabric.directory.leader`); this core
reads it (never changes it) and decides what follows: a won shard is rebuilt from the segments'
reports and served (`StartShard`, `kvfabric.directory.shard_host.ShardHost.start_shard`), a start that
fails is tried again a bounded number of times and then the instance gives up, a shard handed
over stops serving before its lease key is released (`StopShard`), and a lapsed lease, a
refused renewal or a dead election loop stops the whole instance (`StopInstance`: it exits 75
and its supervisor restarts it as a standby). It also answers the question every act of a
served shard asks first: `may_act(shard, epoch, now_ms)`.

## Events
- `Led(shard, epoch)`: the election's StartLeading. `RestartAsked(shard, epoch)`: the host
  rebuilt a served shard for a missing segment and asks that it be started again.
- `StartDone(shard)`, `StartFailed(shard, error)`: the outcome of the shard's StartShard.
- `RetryDue(shard)`: the time of a `RetryStartAt` came.
- `Unled(shard, epoch, reason)`: the election's StopLeading (reasons of `kvfabric.core.leadership`).
- `ElectionEnded(error)`: the election loop ended on its own (it runs forever): nothing renews.

## States of a shard
    IDLE --Led | RestartAsked, led now, not lost--> STARTING(attempt 1) [StartShard(epoch now)]
    IDLE --Led | RestartAsked, not led now or lost--> IDLE
    STARTING --Led | RestartAsked--> STARTING, again (one more start once this one is done)
    STARTING --StartDone, again, led now, not lost--> STARTING(attempt 1) [StartShard(epoch now)]
    STARTING --StartDone--> SERVING (led now) | IDLE (not led now: the host abandoned it)
    STARTING --StartFailed, not lost--> BACKOFF(retry_at = now + retry_ms x attempt) [RetryStartAt]
    STARTING --StartFailed, lost--> IDLE
    BACKOFF --Led | RestartAsked--> BACKOFF (the retry starts the epoch led then)
    BACKOFF --RetryDue, now >= retry_at, not led now--> IDLE (whatever its attempts: an
        instance does not give up over a shard another leads now; review, stop 65)
    BACKOFF --RetryDue, now >= retry_at, led now, attempts spent--> IDLE, the instance LOST
        [StopInstance "shard_start_failed"] (a led shard is never left unserved while its lease
        is renewed)
    BACKOFF --RetryDue, now >= retry_at, led now--> STARTING(attempt + 1) [StartShard]
    BACKOFF --RetryDue, now < retry_at--> BACKOFF [RetryStartAt] (early: wait on)
    SERVING --Led | RestartAsked--> as from IDLE
    any --Unled handover | leaving--> unchanged [StopShard(drain_ms)] (a start in flight is
        abandoned by the host: leadership is gone when it checks)
    any --Unled lease_expired | renew_failed--> unchanged, the instance LOST [StopInstance
        "leadership_lost:<reason>"]
A StartShard carries the epoch `ShardLeadership` gives at that moment, never an older one.

## The instance
    RUNNING --a start given up, a lapsed or refused lease, ElectionEnded--> LOST [StopInstance]
LOST is final (the process exits; a new one starts with a new core). Once LOST, `may_act` is
False for every shard, no StartShard is emitted, and StopInstance is emitted once (its first
reason). `may_act(shard, epoch, now_ms)` = not LOST and `ShardLeadership.epoch(shard, now_ms)`
is `epoch`: the term is ours and its deadline is ahead.

## Invariants (`check_invariants(now_ms)`, after every step in tests; without a time: as of the latest)
1. At most one start in flight or waiting per shard (one state per shard); STARTING and BACKOFF
   have 1 <= attempt <= attempts_max; BACKOFF's retry_at = failed_at + retry_ms x attempt.
2. SERVING and STARTING shards carry an epoch > 0 (the one their StartShard named).
3. LOST => a StopInstance was emitted (exactly one) and no shard is in BACKOFF; no StartShard
   was emitted after it.
4. Accounting: starts = done + failed + STARTING; retries_waiting = BACKOFF.
5. Time never goes backwards.

## Ownership
The shell (`kvfabric.directory.shard_lifecycle.ShardLifecycleShell`) owns the host, the
election loop and the clock, and performs effects in order: StopShard and StopInstance at once
(a StopShard before the election releases the key), StartShard and RetryStartAt in the shard's
own task (a start rebuilds for seconds: other shards' renewals must not wait for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from kvfabric.core.leadership import REASON_HANDOVER, REASON_LEAVING, ShardLeadership
from kvfabric.core.step import not_before
from kvfabric.format.invariant import invariant

__all__ = [
    "START_ATTEMPTS_MAX",
    "ElectionEnded",
    "Event",
    "Led",
    "LifecycleConfig",
    "LifecycleEffect",
    "RestartAsked",
    "RetryDue",
    "RetryStartAt",
    "ShardLifecycle",
    "StartDone",
    "StartFailed",
    "StartShard",
    "StopInstance",
    "StopShard",
    "Unled",
]

START_ATTEMPTS_MAX: Final = 3  # default: a shard start tried this often before the instance gives up
START_RETRY_MS: Final = 500  # default: the n-th failed start is tried again n x this later
HANDOVER_DRAIN_MS: Final = 1_000  # default: a handed-over shard's queued events go out for this long

REASON_START_FAILED: Final = "shard_start_failed"
REASON_ELECTION_FAILED: Final = "election_loop_failed"
LOST_PREFIX: Final = "leadership_lost:"


@dataclass(frozen=True, slots=True)
class LifecycleConfig:
    start_attempts_max: int = START_ATTEMPTS_MAX
    start_retry_ms: int = START_RETRY_MS
    handover_drain_ms: int = HANDOVER_DRAIN_MS

    def __post_init__(self) -> None:
        invariant(self.start_attempts_max >= 1, "need start_attempts_max >= 1")
        invariant(self.start_retry_ms >= 0, "need start_retry_ms >= 0")
        invariant(self.handover_drain_ms >= 0, "need handover_drain_ms >= 0")


# ---- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Led:
    """The election's StartLeading: this instance leads `shard` under `epoch`."""

    shard: int
    epoch: int


@dataclass(frozen=True, slots=True)
class RestartAsked:
    """The host stopped a served shard to rebuild it (a segment it never saw holds bytes) and asks
    it started again under `epoch`."""

    shard: int
    epoch: int


@dataclass(frozen=True, slots=True)
class StartDone:
    """The shard's StartShard returned: served, or abandoned by the host (leadership went)."""

    shard: int


@dataclass(frozen=True, slots=True)
class StartFailed:
    """The shard's StartShard raised (`error`: for the log)."""

    shard: int
    error: str


@dataclass(frozen=True, slots=True)
class RetryDue:
    """The time a `RetryStartAt` named came."""

    shard: int


@dataclass(frozen=True, slots=True)
class Unled:
    """The election's StopLeading (`reason`: lease_expired, renew_failed, handover, leaving)."""

    shard: int
    epoch: int
    reason: str


@dataclass(frozen=True, slots=True)
class ElectionEnded:
    """The election loop ended by itself (an error): no lease is renewed any more."""

    error: str


Event: TypeAlias = Led | RestartAsked | StartDone | StartFailed | RetryDue | Unled | ElectionEnded


# ---- effects -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartShard:
    """Rebuild `shard` from the segments under `epoch` and serve it; answer StartDone or
    StartFailed. `attempt`: 1 for a first try (for the log)."""

    shard: int
    epoch: int
    attempt: int


@dataclass(frozen=True, slots=True)
class RetryStartAt:
    """Answer RetryDue(shard) at `at_ms` (not before)."""

    shard: int
    at_ms: int


@dataclass(frozen=True, slots=True)
class StopShard:
    """Stop serving `shard` at once, before anything else (the election releases its key after);
    its queued events still go out for `drain_ms`, in the background."""

    shard: int
    drain_ms: int


@dataclass(frozen=True, slots=True)
class StopInstance:
    """Stop the whole instance (it exits 75, its supervisor restarts it): `reason` for the log."""

    reason: str


LifecycleEffect: TypeAlias = StartShard | RetryStartAt | StopShard | StopInstance


# ---- the core ----------------------------------------------------------------------------------

_StateName = Literal["idle", "starting", "backoff", "serving"]


@dataclass(slots=True)
class _Shard:
    state: _StateName = "idle"
    epoch: int = 0  # starting, serving: the epoch its StartShard named
    attempt: int = 0  # starting, backoff: this start's try (1..attempts_max)
    again: bool = False  # starting: a start was asked meanwhile (run one more when done)
    failed_at_ms: int = 0  # backoff: when the last try failed
    retry_at_ms: int = 0  # backoff: RetryDue is answered from then on


_COUNTERS: Final = (
    "led_total",
    "restarts_asked_total",
    "starts_total",
    "starts_done_total",
    "starts_failed_total",
    "starts_abandoned_total",  # done while not led any more (the host gave it up)
    "retries_total",
    "starts_given_up_total",
    "handovers_total",
    "leases_lost_total",
    "starts_after_lost_total",  # always 0 (invariant 3)
)


class ShardLifecycle:
    """See the module docstring."""

    def __init__(self, leadership: ShardLeadership, config: LifecycleConfig | None = None) -> None:
        self.leadership = leadership  # read only: which shards are led now, under which epoch
        self.config = config or LifecycleConfig()
        self._shards = [_Shard() for _ in range(leadership.config.shards)]
        self._now_ms = 0
        self.lost_reason: str | None = None  # LOST once set (final)
        self.stops_emitted = 0
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)

    # ---- queries ---------------------------------------------------------------------------

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    def may_act(self, shard: int, epoch: int, now_ms: int) -> bool:
        """Whether this instance may act as the leader of `shard` under `epoch` at `now_ms`."""
        return not self.lost and self.leadership.epoch(shard, now_ms=now_ms) == epoch

    def state(self, shard: int) -> str:
        return self._shards[shard].state

    def serving(self) -> dict[int, int]:
        """shard -> epoch of every shard whose last start returned while it was led."""
        return {s: sh.epoch for s, sh in enumerate(self._shards) if sh.state == "serving"}

    # ---- the one entry -----------------------------------------------------------------------

    def step(self, event: Event, now_ms: int) -> list[LifecycleEffect]:
        """The one entry (`kvfabric.core.step`): time going backwards is refused first."""
        self._now_ms = not_before(self._now_ms, now_ms)
        if isinstance(event, Led | RestartAsked):
            self._count("led_total" if isinstance(event, Led) else "restarts_asked_total")
            return self._want_start(event.shard)
        if isinstance(event, StartDone):
            return self._start_done(event.shard)
        if isinstance(event, StartFailed):
            return self._start_failed(event.shard)
        if isinstance(event, RetryDue):
            return self._retry_due(event.shard)
        if isinstance(event, Unled):
            if event.reason in (REASON_HANDOVER, REASON_LEAVING):
                self._count("handovers_total")
                return [StopShard(event.shard, self.config.handover_drain_ms)]
            self._count("leases_lost_total")
            return self._lose(f"{LOST_PREFIX}{event.reason}")
        return self._lose(REASON_ELECTION_FAILED)  # ElectionEnded

    # ---- transitions -------------------------------------------------------------------------

    def _want_start(self, shard: int) -> list[LifecycleEffect]:
        sh = self._shards[shard]
        if sh.state == "starting":
            sh.again = True  # the running start is followed by one more
            return []
        if sh.state == "backoff":
            return []  # its retry starts the epoch led then
        return self._start(shard, sh, attempt=1)

    def _start(self, shard: int, sh: _Shard, attempt: int) -> list[LifecycleEffect]:
        epoch = self.leadership.epoch(shard, now_ms=self._now_ms)
        if epoch is None or self.lost:
            sh.state, sh.epoch, sh.attempt, sh.again = "idle", 0, 0, False
            return []  # not ours any more: whoever leads it now serves it
        sh.state, sh.epoch, sh.attempt, sh.again = "starting", epoch, attempt, False
        self._count("starts_total")
        return [StartShard(shard, epoch, attempt)]

    def _start_done(self, shard: int) -> list[LifecycleEffect]:
        sh = self._shards[shard]
        invariant(sh.state == "starting", "StartDone without a start in flight", shard=shard)
        self._count("starts_done_total")
        if sh.again:
            return self._start(shard, sh, attempt=1)
        if self.leadership.epoch(shard, now_ms=self._now_ms) is None:
            self._count("starts_abandoned_total")
            sh.state, sh.epoch, sh.attempt = "idle", 0, 0
        else:
            sh.state, sh.attempt = "serving", 0
        return []

    def _start_failed(self, shard: int) -> list[LifecycleEffect]:
        sh = self._shards[shard]
        invariant(sh.state == "starting", "StartFailed without a start in flight", shard=shard)
        self._count("starts_failed_total")
        if self.lost:
            sh.state, sh.epoch, sh.attempt, sh.again = "idle", 0, 0, False
            return []
        sh.state, sh.again = "backoff", False
        sh.failed_at_ms = self._now_ms
        sh.retry_at_ms = self._now_ms + self.config.start_retry_ms * sh.attempt
        return [RetryStartAt(shard, sh.retry_at_ms)]

    def _retry_due(self, shard: int) -> list[LifecycleEffect]:
        sh = self._shards[shard]
        if sh.state != "backoff":
            return []  # the instance was lost meanwhile (BACKOFF cleared)
        if self._now_ms < sh.retry_at_ms:
            return [RetryStartAt(shard, sh.retry_at_ms)]  # early: wait on
        if self.leadership.epoch(shard, now_ms=self._now_ms) is None:
            sh.state, sh.epoch, sh.attempt = "idle", 0, 0  # handed over: whoever leads it serves it
            return []
        if sh.attempt >= self.config.start_attempts_max:
            self._count("starts_given_up_total")
            sh.state, sh.epoch, sh.attempt = "idle", 0, 0
            return self._lose(REASON_START_FAILED)
        self._count("retries_total")
        return self._start(shard, sh, attempt=sh.attempt + 1)

    def _lose(self, reason: str) -> list[LifecycleEffect]:
        if self.lost:
            return []  # stopping already: one StopInstance, its first reason
        self.lost_reason = reason
        for sh in self._shards:
            if sh.state == "backoff":
                sh.state, sh.epoch, sh.attempt = "idle", 0, 0
        self.stops_emitted += 1
        return [StopInstance(reason)]

    def _count(self, name: str) -> None:
        if name == "starts_total" and self.lost:
            self.counters["starts_after_lost_total"] += 1
        self.counters[name] += 1

    def check_invariants(self, now_ms: int | None = None) -> None:
        """O(shards): for tests and debugging. `now_ms`: checked as of then (not before the latest
        event); without it, as of the latest event (the `Core` protocol's check)."""
        cfg = self.config
        now_ms = self._now_ms if now_ms is None else now_ms
        invariant(now_ms >= self._now_ms, "checked at a time before the latest event", now_ms=now_ms)
        invariant(len(self._shards) == self.leadership.config.shards, "shard table resized")
        by_state: dict[str, int] = {}
        for s, sh in enumerate(self._shards):
            by_state[sh.state] = by_state.get(sh.state, 0) + 1
            if sh.state in ("starting", "backoff"):
                invariant(1 <= sh.attempt <= cfg.start_attempts_max, "attempt out of range", shard=s)
            else:
                invariant(sh.attempt == 0 and not sh.again, "attempt kept outside a start", shard=s)
            if sh.state in ("starting", "serving"):
                invariant(sh.epoch > 0, "a start without an epoch", shard=s)
            if sh.state == "backoff":
                invariant(
                    sh.retry_at_ms == sh.failed_at_ms + cfg.start_retry_ms * sh.attempt,
                    "retry time drifted",
                    shard=s,
                )
                invariant(not self.lost, "a retry waiting after the instance was lost", shard=s)
            if sh.state != "starting":
                invariant(not sh.again, "a start asked again outside STARTING", shard=s)
        invariant(self.stops_emitted == (1 if self.lost else 0), "StopInstance not emitted exactly once")
        c = self.counters
        invariant(c["starts_after_lost_total"] == 0, "a StartShard after the instance was lost")
        invariant(
            c["starts_total"]
            == c["starts_done_total"] + c["starts_failed_total"] + by_state.get("starting", 0),
            "start accounting drifted",
        )

"""The shard-leadership core: which directory instance leads which virtual shard, and when it may act.

Synchronous and I/O-free, one entry: `step(event, now_ms) -> effects` (events `Tick`,
`MembersSeen`, `Leave`, `Acquired`, `AcquireFailed`, `Renewed`, `RenewUnanswered`,
`RenewFailed`, `Released`; each is the method of the same meaning, which the states below
name). The directory shell steps `Tick` often (at least every `renew_every_ms / 4`, and at
`next_wakeup_ms()`), feeds in the live member set and the results of the KV operations it
performed, and performs the returned effects in order. Time is passed
in (a monotonic clock, in ms); the core never reads a clock, sleeps or does I/O.

## Model
There are `shards` virtual shards; a chain hash belongs to `shard_of(hash, shards)`. Each shard
has one *lease key* `key_of(shard)` in a JetStream KV bucket whose stream has
`max_age = lease_ttl_ms`: a key not rewritten for `lease_ttl_ms` disappears. An instance leads a
shard by creating the key (`kv.create`, fails if present) and keeps it by rewriting it with
`kv.update(last=revision)` every `renew_every_ms`. KV revisions are the stream sequence: global
and strictly increasing, so the *epoch* of a term (the revision of the create that won it) is
greater than every earlier term's. Renewals produce new revisions; the epoch stays.

Who *should* lead a shard is rendezvous hashing over the live members (`desired_owner`): each
instance announces itself in a member registry (`AnnounceMember`, every `renew_every_ms`) and
the shell feeds back the ids written within `members_ttl_ms` (`on_members`). An instance tries
to acquire only shards in its `desired()`; it wants none while it is not in the member set. A
dead instance drops out of the registry, so its shards become desired by others, who acquire
them once its leases lapse. Adding or removing a member moves only the shards it wins or held.

## States of a shard (per instance)
    IDLE --tick: desired, now >= retry_at_ms--> ACQUIRING [Acquire]
    ACQUIRING --on_acquired, still desired, deadline ahead of now--> LEADING [StartLeading(epoch=revision)]
    ACQUIRING --on_acquired, no longer desired (or leaving, or deadline passed)--> RELEASING [Release]
    ACQUIRING --on_acquire_failed(now)--> IDLE, retry_at = now + renew_every_ms
    LEADING --tick: renew_at_ms reached (written_sent_ms + renew_every_ms), no Renew in flight-->
        LEADING [Renew]
    LEADING --on_renewed(sent_ms, now), now before the deadline--> LEADING, deadline moves to
        sent_ms + ttl - margin (then the deadline check below, against the answer's now_ms)
    LEADING --on_renewed(sent_ms, now), now at or past the deadline--> RELEASING
        [StopLeading "lease_expired", Release(the renewed revision)] (as a tick seeing the time first)
    LEADING --on_renew_unanswered(now)--> LEADING, deadline unchanged, renew_at = now +
        renew_retry_ms (timed out, no responders, no stream leader: the KV may be electing one)
    LEADING --on_renew_failed(now)--> IDLE [StopLeading "renew_failed"], retry after renew_every_ms
        (a definite refusal: the key is not ours at that revision any more)
    LEADING --now >= deadline (tick, or any event carrying now)--> [StopLeading "lease_expired"]
        IDLE (retry at once), or DRAINING when a Renew is in flight
    LEADING --tick: not desired (a member joined, self left the set, `leave`)-->
        [StopLeading "handover" | "leaving"] then RELEASING [Release], or DRAINING (Renew in flight)
    DRAINING --on_renewed--> RELEASING [Release(new revision)]; --on_renew_failed or
        on_renew_unanswered--> IDLE
    RELEASING --on_released (deleted or not: an undeleted key lapses after the TTL)--> IDLE
A result for an operation the core did not ask for is a shell bug (invariant violation).

## Safety (why two instances never act as leader of one shard at the same time)
The deadline of a term is `sent_ms_of_last_successful_write + lease_ttl_ms - safety_margin_ms`.
The server stamps the write when it receives it, after `sent_ms`, so the key outlives the
deadline by at least the margin; the margin covers clock-rate drift between this instance and
the KV servers over one TTL. `epoch(shard, now_ms=...)` is None from the deadline on, whatever
the shell has done. Another instance can create the key only after it lapsed or after this
instance deleted it, and it deletes only after StopLeading, with `last=revision`. A successful
update proves the key stayed ours since the previous write (an expired or re-created key fails
`last=revision`), so nobody else led in between a renewal that lands after the deadline passed;
still, the term ended at its deadline on this instance's clock whichever event sees that time
first: a renewal read after it stops the term as a tick would (`on_renewed` with its `now_ms`),
since the host may have abandoned the shard in that gap (review, stop 65: resumed, the shard
stayed led and unserved). Without `now_ms`, as of the latest event. An answer can arrive
long after its send (a GC pause, a stalled loop): the shell passes `now_ms` (when the answer
reached it) to `on_acquired` and `on_renewed`, so that a create whose term already ended while
its answer waited does not start a term. Its key lapsed meanwhile and another instance may lead
with a greater epoch: starting the stale term would hand the shell an epoch lower than one
already in use.

A renewal without an answer (`on_renew_unanswered`: a timeout, no responders, the KV's stream
electing a leader) leaves the deadline where the last *successful* write put it and asks again
after `renew_retry_ms`: the term never outlives `written_sent_ms + term_ms`, so safety is the
same as if the renewal had never been sent. If it did land, the next Renew (`last=` the older
revision) is refused and the term stops: a spurious stop, never a second leader. Only a definite
refusal (`on_renew_failed`) ends the term before its deadline.

## Invariants (`check_invariants(now_ms)`, after every step in tests; without a time: as of the latest)
1. At most one KV operation in flight per shard (by construction: one state per shard).
2. LEADING => desired, not leaving, revision >= epoch > 0, deadline = written_sent_ms + ttl -
   margin > the latest time seen (expired terms were stopped when their time was seen).
3. Accounting: acquires = acquired + acquire failed + ACQUIRING; renews = renewed + renew
   failed + renew unanswered + Renews in flight; releases = released + RELEASING; started - stopped = LEADING.
4. desired() = the shards `desired_owner` gives this instance over the member set (empty while
   this instance is not a member or is leaving).
5. Time never goes backwards; an operation's `sent_ms` is not before the core asked for it.

## Ownership
The shell owns the KV bucket, the member registry (a bucket with `max_age = members_ttl_ms`,
or the lease bucket when the TTLs are equal) and the clock; the core owns the decision to lead.
The shell serves a shard from StartLeading until StopLeading, and before every act that needs
leadership (fencing with the epoch) asks `epoch(shard, now_ms=now)`. Every effect list puts
StopLeading first: the shell performs those before anything else.

## Size
Over ~600 lines on purpose: a third is this docstring, and the safety argument, the states and
the events that move them are read together (`kvfabric.core.shard_lifecycle` builds on it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

from kvfabric.core.step import Tick, not_before
from kvfabric.format.invariant import invariant, unreachable
from kvfabric.proto.shards import SHARDS_MAX, shard_of_chain

__all__ = [
    "Acquire",
    "AcquireFailed",
    "Acquired",
    "AnnounceMember",
    "Effect",
    "LeadershipConfig",
    "LeadershipEvent",
    "Leave",
    "MembersSeen",
    "Release",
    "Released",
    "Renew",
    "RenewFailed",
    "RenewUnanswered",
    "Renewed",
    "ShardLeadership",
    "StartLeading",
    "StopLeading",
    "Tick",
    "desired_owner",
    "key_of",
    "member_key",
    "shard_of",
]

# SHARDS_MAX (4096) is kvfabric.proto.shards': one bound for the router, the segments and the leaders.
_HASH_PERSON: Final = b"kvf-shard-hrw"

# StopLeading reasons
REASON_LEASE_EXPIRED: Final = "lease_expired"
REASON_RENEW_FAILED: Final = "renew_failed"
REASON_HANDOVER: Final = "handover"
REASON_LEAVING: Final = "leaving"


@dataclass(frozen=True, slots=True)
class LeadershipConfig:
    shards: int  # fixed number of virtual shards (1..4096)
    lease_ttl_ms: int = 3_000  # the KV bucket's max_age
    renew_every_ms: int = 1_000  # leader rewrites its key this often (also: member announce period)
    safety_margin_ms: int = 500  # a leader stops acting this long before its lease could lapse in KV
    members_ttl_ms: int = 3_000  # liveness of instances in the member registry
    renew_retry_ms: int = 250  # a renewal left unanswered is sent again this much later

    def __post_init__(self) -> None:
        invariant(1 <= self.shards <= SHARDS_MAX, "shards must be in 1..4096", shards=self.shards)
        invariant(0 < self.safety_margin_ms < self.lease_ttl_ms, "need 0 < safety_margin_ms < lease_ttl_ms")
        # One lost or slow renewal must not cost the lease.
        invariant(
            0 < 2 * self.renew_every_ms <= self.lease_ttl_ms - self.safety_margin_ms,
            "need 2 x renew_every_ms <= lease_ttl_ms - safety_margin_ms",
        )
        invariant(2 * self.renew_every_ms <= self.members_ttl_ms, "need 2 x renew_every_ms <= members_ttl_ms")
        invariant(0 < self.renew_retry_ms <= self.renew_every_ms, "need 0 < renew_retry_ms <= renew_every_ms")

    @property
    def term_ms(self) -> int:
        """How long after a write's send time its writer may act: lease_ttl_ms - safety_margin_ms."""
        return self.lease_ttl_ms - self.safety_margin_ms


# ---- effects -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Acquire:
    """kv.create(key_of(shard), instance_id) -> on_acquired(shard, revision, sent_ms), or
    on_acquire_failed(shard, now_ms) when the key exists, the KV is unreachable or it timed out."""

    shard: int


@dataclass(frozen=True, slots=True)
class Renew:
    """kv.update(key_of(shard), instance_id, last=revision) -> on_renewed(shard, new_revision,
    sent_ms), on_renew_failed(shard, now_ms) (refused: wrong last revision), or
    on_renew_unanswered(shard, now_ms) (no answer: timed out, no responders, unavailable)."""

    shard: int
    revision: int


@dataclass(frozen=True, slots=True)
class Release:
    """kv.delete(key_of(shard), last=revision) -> on_released(shard), whatever the outcome."""

    shard: int
    revision: int


@dataclass(frozen=True, slots=True)
class StartLeading:
    """Start serving `shard`, fencing with `epoch` (the revision of the winning create)."""

    shard: int
    epoch: int


@dataclass(frozen=True, slots=True)
class StopLeading:
    """Stop serving `shard` at once, before performing anything else. `reason`: lease_expired,
    renew_failed, handover or leaving."""

    shard: int
    epoch: int
    reason: str


@dataclass(frozen=True, slots=True)
class AnnounceMember:
    """kv.put(member_key(instance_id), ...): this instance is alive. No result is fed back."""


Effect: TypeAlias = Acquire | Renew | Release | StartLeading | StopLeading | AnnounceMember


# ---- events (`ShardLeadership.step`: one entry for every event and the time) ----------------------
# `Tick` (time passed: `tick`) is the one every core shares (`kvfabric.core.step`).


@dataclass(frozen=True, slots=True)
class MembersSeen:
    """The live instance ids of the member registry (`on_members`)."""

    members: frozenset[str]


@dataclass(frozen=True, slots=True)
class Leave:
    """Graceful shutdown (`leave`)."""


@dataclass(frozen=True, slots=True)
class Acquired:
    """An Acquire won at `revision`, sent at `sent_ms` (`on_acquired`; the step's now_ms is when
    the answer came)."""

    shard: int
    revision: int
    sent_ms: int


@dataclass(frozen=True, slots=True)
class AcquireFailed:
    """An Acquire lost, failed or timed out (`on_acquire_failed`)."""

    shard: int


@dataclass(frozen=True, slots=True)
class Renewed:
    """A Renew landed at `revision`, sent at `sent_ms` (`on_renewed`)."""

    shard: int
    revision: int
    sent_ms: int


@dataclass(frozen=True, slots=True)
class RenewUnanswered:
    """A Renew got no answer (`on_renew_unanswered`)."""

    shard: int


@dataclass(frozen=True, slots=True)
class RenewFailed:
    """A Renew was refused (`on_renew_failed`)."""

    shard: int


@dataclass(frozen=True, slots=True)
class Released:
    """A Release finished, deleted or not (`on_released`)."""

    shard: int


LeadershipEvent: TypeAlias = (
    Tick | MembersSeen | Leave | Acquired | AcquireFailed | Renewed | RenewUnanswered | RenewFailed | Released
)


# ---- pure helpers ------------------------------------------------------------------------------


def shard_of(chain_hash: bytes, shards: int) -> int:
    """The shard of a chain hash: the little-endian u32 of its first 4 bytes, mod `shards`
    (`kvfabric.proto.shards.shard_of_chain`, the one rule; a bad argument is a bug here)."""
    invariant(len(chain_hash) >= 4, "chain hash shorter than 4 bytes", length=len(chain_hash))
    invariant(1 <= shards <= SHARDS_MAX, "shards out of range", shards=shards)
    return shard_of_chain(chain_hash, shards)


def _weight(shard: int, member: str) -> int:
    digest = hashlib.blake2b(
        shard.to_bytes(4, "little") + member.encode("utf-8"), digest_size=8, person=_HASH_PERSON
    ).digest()
    return int.from_bytes(digest, "little")


def desired_owner(shard: int, members: Iterable[str]) -> str:
    """Rendezvous (highest random weight) hashing: the member with the highest
    blake2b(shard, member) weight; ties (never seen in practice) go to the greater id."""
    best: tuple[int, str] | None = None
    for member in members:
        candidate = (_weight(shard, member), member)
        if best is None or candidate > best:
            best = candidate
    if best is None:
        unreachable("desired_owner needs at least one member", shard=shard)
    return best[1]


def key_of(shard: int) -> str:
    """The lease key of a shard in the leadership bucket."""
    return f"shard-{shard}"


def member_key(instance_id: str) -> str:
    """The registry key of an instance (instance ids must be valid KV key tokens)."""
    return f"member-{instance_id}"


# ---- the core ----------------------------------------------------------------------------------

_StateName = Literal["idle", "acquiring", "leading", "draining", "releasing"]


@dataclass(slots=True)
class _Shard:
    state: _StateName = "idle"
    epoch: int = 0  # leading: revision of the winning create
    revision: int = 0  # leading, draining, releasing: the last revision known to hold our value
    written_sent_ms: int = 0  # leading: sent_ms of the last successful write
    renew_at_ms: int = 0  # leading: the next Renew is due (written_sent_ms + renew_every_ms, or
    # renew_retry_ms after an unanswered one)
    deadline_ms: int = 0  # leading: written_sent_ms + term_ms; may act strictly before it
    renewing: bool = False  # leading: a Renew is in flight (draining: always)
    op_emitted_ms: int = 0  # an operation in flight: when the core asked for it
    retry_at_ms: int = 0  # idle: no Acquire before this


@dataclass(slots=True)
class _Out:
    stops: list[Effect] = field(default_factory=list)
    rest: list[Effect] = field(default_factory=list)

    def effects(self) -> list[Effect]:
        return self.stops + self.rest


_COUNTERS: Final = (
    "acquires_total",
    "acquired_total",
    "acquired_unwanted_total",
    "acquire_failed_total",
    "renews_total",
    "renewed_total",
    "renew_failed_total",
    "renew_unanswered_total",
    "releases_total",
    "released_total",
    "leading_started_total",
    "leading_stopped_total",
    "lease_expired_total",
    "handovers_total",
    "announces_total",
    "members_changed_total",
)


class ShardLeadership:
    """See the module docstring."""

    def __init__(self, config: LeadershipConfig, instance_id: str) -> None:
        invariant(bool(instance_id), "empty instance id")
        self.config = config
        self.instance_id = instance_id
        self._shards = [_Shard() for _ in range(config.shards)]
        self._members: frozenset[str] = frozenset()
        self._desired: frozenset[int] = frozenset()
        self._leaving = False
        self._now_ms = 0  # the latest time seen
        self._next_announce_ms: int | None = None  # None: announce at the next tick
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)

    # ---- queries ---------------------------------------------------------------------------

    def epoch(self, shard: int, now_ms: int | None = None) -> int | None:
        """The epoch if this instance may act as leader of `shard`. Without `now_ms`, as of the
        latest event; with it (the shell should pass it), also None once the deadline passed."""
        sh = self._shards[shard]
        if sh.state != "leading":
            return None
        if now_ms is not None and now_ms >= sh.deadline_ms:
            return None
        return sh.epoch

    def leading(self, now_ms: int | None = None) -> dict[int, int]:
        """shard -> epoch for every shard this instance leads (see `epoch` for `now_ms`)."""
        return {
            s: sh.epoch
            for s, sh in enumerate(self._shards)
            if sh.state == "leading" and (now_ms is None or now_ms < sh.deadline_ms)
        }

    def held(self, now_ms: int) -> dict[int, int]:
        """shard -> its key's revision, for every shard led at `now_ms` with no Renew in flight
        (a Renew in flight may have moved the revision). An instance that has stopped serving
        may delete those keys (`kv.delete(last=revision)`) so that a standby takes over at once
        rather than after the TTL; the others lapse."""
        return {
            s: sh.revision
            for s, sh in enumerate(self._shards)
            if sh.state == "leading" and not sh.renewing and now_ms < sh.deadline_ms
        }

    def desired(self) -> set[int]:
        """Shards this instance should own under the current member set."""
        return set(self._desired)

    def members(self) -> frozenset[str]:
        return self._members

    def deadline_ms(self, shard: int) -> int | None:
        """When the current term of `shard` stops (None when not leading)."""
        sh = self._shards[shard]
        return sh.deadline_ms if sh.state == "leading" else None

    def next_wakeup_ms(self) -> int | None:
        """The earliest time `tick` has something to do (a deadline, a renewal, a retry, an
        announcement); None when nothing is scheduled. The shell ticks at least by then."""
        times: list[int] = []
        if not self._leaving:
            times.append(self._next_announce_ms if self._next_announce_ms is not None else self._now_ms)
        for s, sh in enumerate(self._shards):
            if sh.state == "leading":
                times.append(sh.deadline_ms)
                if not sh.renewing:
                    times.append(sh.renew_at_ms)
            elif sh.state == "idle" and s in self._desired:
                times.append(sh.retry_at_ms)
        return min(times) if times else None

    def in_flight(self) -> int:
        """KV operations in flight (Acquire, Renew, Release)."""
        return sum(1 for sh in self._shards if sh.state != "idle" and (sh.state != "leading" or sh.renewing))

    def drained(self) -> bool:
        """Nothing led, nothing in flight: after `leave`, the shell may exit."""
        return all(sh.state == "idle" for sh in self._shards)

    # ---- events ----------------------------------------------------------------------------

    def step(self, event: LeadershipEvent, now_ms: int) -> list[Effect]:
        """The one entry (the shape every core shares, `kvfabric.core.step`): `event` at `now_ms`,
        the effects to perform. Each event is the method of the same meaning below, given
        `now_ms`. Time going backwards is refused first, before any method changes anything."""
        not_before(self._now_ms, now_ms)
        if isinstance(event, Tick):
            return self.tick(now_ms)
        if isinstance(event, MembersSeen):
            return self.on_members(set(event.members), now_ms)
        if isinstance(event, Leave):
            return self.leave(now_ms)
        if isinstance(event, Acquired):
            return self.on_acquired(event.shard, event.revision, event.sent_ms, now_ms=now_ms)
        if isinstance(event, AcquireFailed):
            return self.on_acquire_failed(event.shard, now_ms)
        if isinstance(event, Renewed):
            return self.on_renewed(event.shard, event.revision, event.sent_ms, now_ms=now_ms)
        if isinstance(event, RenewUnanswered):
            return self.on_renew_unanswered(event.shard, now_ms)
        if isinstance(event, RenewFailed):
            return self.on_renew_failed(event.shard, now_ms)
        return self.on_released(event.shard)  # Released: no time-dependent decision

    def tick(self, now_ms: int) -> list[Effect]:
        """Stop expired terms, hand over shards no longer desired, renew, acquire, announce."""
        self._advance(now_ms)
        cfg = self.config
        out = _Out()
        for s, sh in enumerate(self._shards):
            if sh.state == "leading":
                if now_ms >= sh.deadline_ms:
                    self._expire(s, sh, out)
                elif s not in self._desired:
                    self._stop(s, sh, REASON_LEAVING if self._leaving else REASON_HANDOVER, out)
                    self._count("handovers_total")
                    if sh.renewing:
                        sh.state = "draining"
                    else:
                        self._release(s, sh, out)
                elif not sh.renewing and now_ms >= sh.renew_at_ms:
                    sh.renewing = True
                    sh.op_emitted_ms = now_ms
                    self._count("renews_total")
                    out.rest.append(Renew(s, sh.revision))
            elif sh.state == "idle" and s in self._desired and now_ms >= sh.retry_at_ms:
                sh.state = "acquiring"
                sh.op_emitted_ms = now_ms
                self._count("acquires_total")
                out.rest.append(Acquire(s))
        if not self._leaving and (self._next_announce_ms is None or now_ms >= self._next_announce_ms):
            self._next_announce_ms = now_ms + cfg.renew_every_ms
            self._count("announces_total")
            out.rest.append(AnnounceMember())
        return out.effects()

    def on_members(self, members: set[str], now_ms: int) -> list[Effect]:
        """The live instance ids from the member registry (self included once announced).
        Recomputes `desired()` and then ticks."""
        members_now = frozenset(members)
        if members_now != self._members:
            self._members = members_now
            self._count("members_changed_total")
            if not self._leaving:
                self._desired = self._compute_desired()
        return self.tick(now_ms)

    def leave(self, now_ms: int) -> list[Effect]:
        """Graceful shutdown: desire nothing, stop announcing, hand every shard over. The shell
        deletes its member key and exits once `drained()`."""
        self._leaving = True
        self._desired = frozenset()
        return self.tick(now_ms)

    def on_acquired(self, shard: int, revision: int, sent_ms: int, now_ms: int | None = None) -> list[Effect]:
        """The create won: this instance held the key at `revision` (sent at `sent_ms`). `now_ms`:
        when the answer arrived (the shell should pass it): a term whose deadline is not ahead of
        it is not started but released. Without it, as of the latest event."""
        sh = self._shards[shard]
        invariant(sh.state == "acquiring", "on_acquired without an Acquire in flight", shard=shard)
        invariant(revision > 0, "KV revisions start at 1", revision=revision)
        self._check_sent(shard, sh, sent_ms)
        if now_ms is not None:
            self._advance(now_ms)
        self._count("acquired_total")
        out = _Out()
        sh.revision = revision
        deadline_ms = sent_ms + self.config.term_ms
        if self._leaving or shard not in self._desired or deadline_ms <= self._now_ms:
            self._count("acquired_unwanted_total")
            self._release(shard, sh, out)
        else:
            sh.state = "leading"
            sh.epoch = revision
            sh.written_sent_ms = sent_ms
            sh.renew_at_ms = sent_ms + self.config.renew_every_ms
            sh.deadline_ms = deadline_ms
            sh.renewing = False
            self._count("leading_started_total")
            out.rest.append(StartLeading(shard, revision))
        self._expire_all(out)
        return out.effects()

    def on_acquire_failed(self, shard: int, now_ms: int) -> list[Effect]:
        """The create lost (the key exists), or the KV was unreachable, or it timed out (then
        the create may still land: the key lapses after the TTL, nobody renewing it)."""
        sh = self._shards[shard]
        invariant(sh.state == "acquiring", "on_acquire_failed without an Acquire in flight", shard=shard)
        self._advance(now_ms)
        self._count("acquire_failed_total")
        sh.state = "idle"
        sh.retry_at_ms = now_ms + self.config.renew_every_ms
        out = _Out()
        self._expire_all(out)
        return out.effects()

    def on_renewed(self, shard: int, revision: int, sent_ms: int, now_ms: int | None = None) -> list[Effect]:
        """The update landed: the key holds our value at `revision`, written after `sent_ms`.
        `now_ms`: when the answer arrived (the shell should pass it): a term whose new deadline is
        not ahead of it stops (lease_expired). Without it, as of the latest event."""
        sh = self._shards[shard]
        invariant(
            sh.state in ("leading", "draining") and sh.renewing,
            "on_renewed without a Renew in flight",
            shard=shard,
        )
        invariant(revision > sh.revision, "a renewal must produce a newer revision", shard=shard)
        self._check_sent(shard, sh, sent_ms)
        if now_ms is not None:
            self._advance(now_ms)
        out = _Out()
        if sh.state == "leading" and self._now_ms >= sh.deadline_ms:
            # Its deadline passed before this answer was read: the term ended then (`epoch(now)`
            # was None, and the host may have abandoned the shard's start in that gap). Resumed,
            # the shard stayed led and unserved until the process restarted (review, stop 65).
            # It ends as if a tick had seen the time first; the key is handed back below.
            self._expire(shard, sh, out)
        self._count("renewed_total")
        sh.renewing = False
        sh.revision = revision
        if sh.state == "draining":
            self._release(shard, sh, out)
        else:
            # Sent after the previous write, so the deadline only moves later (and it is ahead of
            # every time seen: a passed one was stopped when its time was seen).
            invariant(sent_ms >= sh.written_sent_ms, "a renewal sent before the write it renews")
            sh.written_sent_ms = sent_ms
            sh.renew_at_ms = sent_ms + self.config.renew_every_ms
            sh.deadline_ms = sent_ms + self.config.term_ms
        self._expire_all(out)
        return out.effects()

    def on_renew_unanswered(self, shard: int, now_ms: int) -> list[Effect]:
        """No answer (timed out, no responders, the KV's stream without a leader): the term goes
        on until its deadline, unchanged, and the renewal is sent again after `renew_retry_ms`
        (module docstring, Safety). Draining: the key is left to lapse (IDLE)."""
        sh = self._shards[shard]
        invariant(
            sh.state in ("leading", "draining") and sh.renewing,
            "on_renew_unanswered without a Renew in flight",
            shard=shard,
        )
        self._advance(now_ms)
        self._count("renew_unanswered_total")
        sh.renewing = False
        if sh.state == "leading":
            sh.renew_at_ms = now_ms + self.config.renew_retry_ms
        else:
            sh.state = "idle"
            sh.retry_at_ms = now_ms + self.config.renew_every_ms
        out = _Out()
        self._expire_all(out)
        return out.effects()

    def on_renew_failed(self, shard: int, now_ms: int) -> list[Effect]:
        """Refused (wrong last revision: the key expired or is another's): the term ends now."""
        sh = self._shards[shard]
        invariant(
            sh.state in ("leading", "draining") and sh.renewing,
            "on_renew_failed without a Renew in flight",
            shard=shard,
        )
        self._advance(now_ms)
        self._count("renew_failed_total")
        sh.renewing = False
        out = _Out()
        if sh.state == "leading":
            self._stop(shard, sh, REASON_RENEW_FAILED, out)
        sh.state = "idle"
        sh.retry_at_ms = now_ms + self.config.renew_every_ms
        self._expire_all(out)
        return out.effects()

    def on_released(self, shard: int) -> list[Effect]:
        """The delete finished (or failed: the key then lapses after the TTL)."""
        sh = self._shards[shard]
        invariant(sh.state == "releasing", "on_released without a Release in flight", shard=shard)
        self._count("released_total")
        sh.state = "idle"
        sh.retry_at_ms = self._now_ms
        return []

    # ---- internals -------------------------------------------------------------------------

    def _compute_desired(self) -> frozenset[int]:
        if self.instance_id not in self._members:
            return frozenset()
        return frozenset(
            s for s in range(self.config.shards) if desired_owner(s, self._members) == self.instance_id
        )

    def _stop(self, shard: int, sh: _Shard, reason: str, out: _Out) -> None:
        self._count("leading_stopped_total")
        out.stops.append(StopLeading(shard, sh.epoch, reason))

    def _expire(self, shard: int, sh: _Shard, out: _Out) -> None:
        """The term's deadline passed: stop; keep waiting for a Renew in flight."""
        self._stop(shard, sh, REASON_LEASE_EXPIRED, out)
        self._count("lease_expired_total")
        if sh.renewing:
            sh.state = "draining"
        else:
            sh.state = "idle"
            sh.retry_at_ms = self._now_ms

    def _expire_all(self, out: _Out) -> None:
        """Stop every term whose deadline the latest time seen reached."""
        for s, sh in enumerate(self._shards):
            if sh.state == "leading" and self._now_ms >= sh.deadline_ms:
                self._expire(s, sh, out)

    def _release(self, shard: int, sh: _Shard, out: _Out) -> None:
        sh.state = "releasing"
        sh.renewing = False
        sh.op_emitted_ms = self._now_ms
        self._count("releases_total")
        out.rest.append(Release(shard, sh.revision))

    def _check_sent(self, shard: int, sh: _Shard, sent_ms: int) -> None:
        invariant(
            sent_ms >= sh.op_emitted_ms,
            "sent_ms before the core asked for the operation (clock mix-up?)",
            shard=shard,
            sent_ms=sent_ms,
            emitted_ms=sh.op_emitted_ms,
        )

    def _advance(self, now_ms: int) -> None:
        invariant(now_ms >= self._now_ms, "time went backwards", now_ms=now_ms, last_ms=self._now_ms)
        self._now_ms = now_ms

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def check_invariants(self, now_ms: int | None = None) -> None:
        """O(shards x members): for tests and debugging. `now_ms`: checked as of then (not before
        the latest event); without it, as of the latest event (the `Core` protocol's check)."""
        cfg = self.config
        now_ms = self._now_ms if now_ms is None else now_ms
        invariant(now_ms >= self._now_ms, "checked at a time before the latest event", now_ms=now_ms)
        invariant(len(self._shards) == cfg.shards, "shard table resized")
        expected_desired = frozenset() if self._leaving else self._compute_desired()
        invariant(self._desired == expected_desired, "desired set drifted from the member set")
        by_state: dict[str, int] = {}
        renewing = 0
        for s, sh in enumerate(self._shards):
            by_state[sh.state] = by_state.get(sh.state, 0) + 1
            renewing += sh.renewing
            if sh.state == "leading":
                invariant(s in self._desired, "leading a shard not desired", shard=s)
                invariant(0 < sh.epoch <= sh.revision, "epoch above the known revision", shard=s)
                invariant(sh.deadline_ms == sh.written_sent_ms + cfg.term_ms, "deadline drifted", shard=s)
                invariant(sh.deadline_ms > self._now_ms, "leading past a deadline already seen", shard=s)
            elif sh.state == "draining":
                invariant(sh.renewing, "draining without a Renew in flight", shard=s)
            else:
                invariant(not sh.renewing, "a Renew in flight outside leading/draining", shard=s)
        c = self.counters
        invariant(
            c["acquires_total"]
            == c["acquired_total"] + c["acquire_failed_total"] + by_state.get("acquiring", 0),
            "acquire accounting drifted",
        )
        invariant(
            c["renews_total"]
            == c["renewed_total"] + c["renew_failed_total"] + c["renew_unanswered_total"] + renewing,
            "renew accounting drifted",
        )
        invariant(
            c["releases_total"] == c["released_total"] + by_state.get("releasing", 0),
            "release accounting drifted",
        )
        invariant(
            c["leading_started_total"] - c["leading_stopped_total"] == by_state.get("leading", 0),
            "start/stop accounting drifted",
        )
        invariant(not self._leaving or not self._desired, "leaving but still desiring shards")

"""The load table of the engine-side client: coalescing of loads and ownership of buffers.

Synchronous and I/O-free: no clock, no asyncio, no memory. The client shell owns the transports,
the staging buffers and the copies; it feeds events in (`want`, `transfer_done`, `delivered`,
`cancel`, `expire`, or all through one entry: `step(event, now_ms)`, `kvfabric.core.step`, the
events in `kvfabric.core.client_loads_events`, `Tick` for `expire`), performs the returned
effects in order, and asks `may_write` right before every copy into an engine buffer. Time is
passed in (`now_ms`, `deadline_ms`).

## Model
An engine *load* (a waiter) is (load id, `RequestGeneration`, destination buffer id, deadline): it
asks for one object's bytes in a buffer the engine owns. A *transfer* fetches one object once into
a staging buffer (named by its transfer id; ids are never reused); every waiter wanting that
object while the transfer is live joins it (coalescing: one transfer, many waiters).

## States of a waiter
    (absent) --want, a live transfer for the object, or room to start one--> WAITING
    (absent) --want, no room (transfers_max / inflight_bytes_max)--> Busy, never registered
    WAITING --transfer_done ok--> DELIVERING (effect Deliver)
    WAITING --want joining a transfer already DELIVERING--> DELIVERING at once
    WAITING/DELIVERING --transfer_done failed--> ended: Fail(cause)
    WAITING/DELIVERING --deadline passed (expire)--> ended: Fail("timeout")
    WAITING/DELIVERING --cancel--> ended (the engine knows)
    DELIVERING --delivered (the shell copied staging into dest)--> ended: success
A waiter has exactly one outcome; an ended waiter is forgotten (its load id may come back).

## States of a transfer
    (absent) --want, none live for the object--> FETCHING (effect StartTransfer)
    FETCHING --transfer_done ok--> DELIVERING --last waiter leaves--> (absent), ReleaseStaging
    FETCHING --transfer_done failed--> (absent), ReleaseStaging
    FETCHING --last waiter leaves--> CANCELLED (effect CancelTransfer)
    CANCELLED --transfer_done (late completion, counted)--> (absent), ReleaseStaging
A `transfer_done` naming a transfer that is not FETCHING or CANCELLED (never started, or a second
answer) is counted and ignored.

## Invariants (checked by `check_invariants()` in tests, after every step)
1. Every live waiter is attached to exactly one live (FETCHING/DELIVERING) transfer, which lists
   it; no live transfer is without waiters (it was cancelled or released); at most one live
   transfer per object.
2. Generations fence stale actors (docs/design.md 3.4): a destination's generation only grows; a want
   with an older or equal one is rejected (`StaleGeneration`, counted). `may_write` is True only
   for a DELIVERING waiter named with its own generation and dest, the current one for that dest;
   so a cancelled or timed-out waiter's late completion never writes into its old destination.
3. A dest id is held by at most one live waiter.
4. Bounded (3.6): transfers holding staging (FETCHING, DELIVERING, CANCELLED) <= `transfers_max`
   and their bytes <= `inflight_bytes_max`; a full table answers `Busy` instead of queueing.
   Live waiters are bounded by the engine's destination buffers (one each).
5. No leaks (3.7): every StartTransfer gets exactly one ReleaseStaging, once its bytes are no
   longer needed and the transport no longer writes into them (CANCELLED waits for the answer).

## Ownership
- Destination buffers belong to the engine, lent to the client from `want` until the waiter's
  outcome (Fail, or `delivered` accepted) or `cancel`. After that the engine may reuse it at
  once, with a newer generation. The shell therefore runs `may_write` -> copy -> `delivered` as
  one step, with no cancel or expire in between (or it defers them until the copy is done).
- Staging buffers belong to the client from StartTransfer until ReleaseStaging; the transport
  writes into one only until it answers `transfer_done`. Every StartTransfer must be answered
  exactly once, also after CancelTransfer (the transport bounds its own attempts with a timeout).
- Retry budgets are the shell's: after a Fail it may `want` again, with a new generation.
  Failures are counted per cause in `counters`.
- Caller bugs raise `InvariantViolation`: a second live waiter with one load id or dest, time
  going backwards, `delivered` for a waiter that is not DELIVERING, a size differing between
  waiters of one transfer.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Final, Literal, NewType, TypeAlias

from kvfabric.core import client_loads_events
from kvfabric.core.client_loads_events import LoadEvent
from kvfabric.core.step import not_before
from kvfabric.format.errors import BadRequest, StaleGeneration
from kvfabric.format.generations import RequestGeneration
from kvfabric.format.invariant import invariant

__all__ = [
    "Busy",
    "CancelTransfer",
    "Deliver",
    "DestId",
    "Effect",
    "Fail",
    "LoadId",
    "LoadTable",
    "ObjectId",
    "ReleaseStaging",
    "StartTransfer",
    "TransferId",
]

LoadId: TypeAlias = Hashable
ObjectId: TypeAlias = Hashable
DestId: TypeAlias = Hashable
TransferId = NewType("TransferId", int)

TIMEOUT: Final = "timeout"


@dataclass(frozen=True, slots=True)
class StartTransfer:
    """Fetch `object_id` into a new staging buffer named `transfer_id`; answer `transfer_done`."""

    transfer_id: TransferId
    object_id: ObjectId
    size_bytes: int


@dataclass(frozen=True, slots=True)
class CancelTransfer:
    """Nobody waits any more: stop the transfer if possible (it must still be answered)."""

    transfer_id: TransferId


@dataclass(frozen=True, slots=True)
class ReleaseStaging:
    """The staging buffer of `transfer_id` is free again."""

    transfer_id: TransferId


@dataclass(frozen=True, slots=True)
class Deliver:
    """Copy staging of `transfer_id` into `dest_id` (if `may_write`), then call `delivered`."""

    load_id: LoadId
    generation: RequestGeneration
    dest_id: DestId
    transfer_id: TransferId


@dataclass(frozen=True, slots=True)
class Fail:
    """The load ended without bytes (`cause`: the transport's, or "timeout"): recompute."""

    load_id: LoadId
    cause: str


@dataclass(frozen=True, slots=True)
class Busy:
    """The load was not accepted (`cause`: "transfers" or "bytes" full). Back off or recompute."""

    load_id: LoadId
    cause: str


Effect: TypeAlias = StartTransfer | CancelTransfer | ReleaseStaging | Deliver | Fail | Busy


@dataclass(slots=True)
class _Waiter:
    generation: RequestGeneration
    dest_id: DestId
    transfer_id: TransferId
    deadline_ms: int
    seq: int  # tells a live waiter from an earlier one with the same load id (deadline heap)
    delivering: bool = False


@dataclass(slots=True)
class _Transfer:
    object_id: ObjectId
    size_bytes: int
    state: Literal["fetching", "delivering"] = "fetching"
    waiters: dict[LoadId, None] = field(default_factory=dict)  # insertion-ordered set


class LoadTable:
    """One engine client's loads and transfers. See the module docstring."""

    def __init__(self, *, transfers_max: int, inflight_bytes_max: int | None = None) -> None:
        invariant(transfers_max >= 1, "transfers_max must be at least 1", transfers_max=transfers_max)
        invariant(
            inflight_bytes_max is None or inflight_bytes_max >= 1,
            "inflight_bytes_max must be positive",
            inflight_bytes_max=inflight_bytes_max,
        )
        self.transfers_max: Final = transfers_max
        self.inflight_bytes_max: Final = inflight_bytes_max
        self._waiters: dict[LoadId, _Waiter] = {}
        self._dest_holder: dict[DestId, LoadId] = {}
        self._dest_generation: dict[DestId, RequestGeneration] = {}  # one per engine buffer ever used
        self._transfers: dict[TransferId, _Transfer] = {}  # FETCHING or DELIVERING
        self._by_object: dict[ObjectId, TransferId] = {}
        self._cancelled: dict[TransferId, int] = {}  # CANCELLED -> size_bytes
        self._deadlines: list[tuple[int, int, LoadId]] = []  # heap (deadline_ms, seq, load id), lazy
        self._next_transfer = 1
        self._seq = 0
        self._now_ms = 0
        self._step_ms = 0  # the latest time given to `step` (events without a time included)
        self._held_bytes = 0
        self.counters: dict[str, int] = {}

    def step(self, event: LoadEvent, now_ms: int) -> list[Effect]:
        """The one entry (`kvfabric.core.step`): `event` at `now_ms` as the method of the same
        meaning (`Tick`: `expire`). Time going backwards is refused first."""
        self._step_ms = not_before(max(self._step_ms, self._now_ms), now_ms)
        return client_loads_events.dispatch(self, event, now_ms)

    # ---- stats -------------------------------------------------------------------------------

    @property
    def waiters_live(self) -> int:
        return len(self._waiters)

    @property
    def transfers_held(self) -> int:
        """Transfers holding a staging buffer: FETCHING, DELIVERING and CANCELLED."""
        return len(self._transfers) + len(self._cancelled)

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    # ---- events ------------------------------------------------------------------------------

    def want(
        self,
        load_id: LoadId,
        generation: RequestGeneration,
        object_id: ObjectId,
        dest_id: DestId,
        *,
        now_ms: int,
        deadline_ms: int,
        size_bytes: int = 0,
    ) -> list[Effect]:
        """Load `object_id` into `dest_id`. Raises `StaleGeneration` for a generation not newer
        than the dest's last one, `BadRequest` for an object larger than `inflight_bytes_max`."""
        self._advance(now_ms)
        invariant(load_id not in self._waiters, "load id already live", load_id=load_id)
        invariant(dest_id not in self._dest_holder, "dest held by a live load", dest_id=dest_id)
        invariant(size_bytes >= 0, "negative size", size_bytes=size_bytes)
        last = self._dest_generation.get(dest_id)
        if last is not None and generation <= last:
            self._count("stale_generation_total")
            raise StaleGeneration(RequestGeneration.kind, generation.value, last.value)
        if self.inflight_bytes_max is not None and size_bytes > self.inflight_bytes_max:
            raise BadRequest("object larger than inflight_bytes_max", size_bytes=size_bytes)
        self._count("wants_total")
        effects: list[Effect] = []
        transfer_id = self._by_object.get(object_id)
        if transfer_id is None:
            busy = self._busy_cause(size_bytes)
            if busy is not None:
                self._count(f"busy_{busy}_total")
                return [Busy(load_id, busy)]
            transfer_id = TransferId(self._next_transfer)
            self._next_transfer += 1
            self._transfers[transfer_id] = _Transfer(object_id, size_bytes)
            self._by_object[object_id] = transfer_id
            self._held_bytes += size_bytes
            self._count("transfers_started_total")
            effects.append(StartTransfer(transfer_id, object_id, size_bytes))
        else:
            self._count("joins_total")
        transfer = self._transfers[transfer_id]
        invariant(transfer.size_bytes == size_bytes, "size differs within a transfer", object_id=object_id)
        self._seq += 1
        waiter = _Waiter(generation, dest_id, transfer_id, deadline_ms, self._seq)
        self._waiters[load_id] = waiter
        self._dest_holder[dest_id] = load_id
        self._dest_generation[dest_id] = generation
        transfer.waiters[load_id] = None
        heapq.heappush(self._deadlines, (deadline_ms, waiter.seq, load_id))
        if transfer.state == "delivering":
            waiter.delivering = True
            self._count("delivers_total")
            effects.append(Deliver(load_id, generation, dest_id, transfer_id))
        return effects

    def transfer_done(self, transfer_id: TransferId, ok: bool, cause: str = "error") -> list[Effect]:
        """The transport answered `transfer_id`: bytes in staging (`ok`) or failed with `cause`."""
        if transfer_id in self._cancelled:
            self._held_bytes -= self._cancelled.pop(transfer_id)
            self._count("late_completions_total")
            return [ReleaseStaging(transfer_id)]
        transfer = self._transfers.get(transfer_id)
        if transfer is None or transfer.state != "fetching":
            self._count("transfer_done_unknown_total")
            return []
        if ok:
            transfer.state = "delivering"
            effects: list[Effect] = []
            for load_id in transfer.waiters:
                waiter = self._waiters[load_id]
                waiter.delivering = True
                self._count("delivers_total")
                effects.append(Deliver(load_id, waiter.generation, waiter.dest_id, transfer_id))
            return effects
        self._count(f"transfers_failed_{cause}_total")
        effects = [Fail(load_id, cause) for load_id in transfer.waiters]
        for load_id in list(transfer.waiters):
            effects += self._end(load_id, f"failed_{cause}", answered=True)  # last: ReleaseStaging
        return effects

    def delivered(self, load_id: LoadId, generation: RequestGeneration, dest_id: DestId) -> list[Effect]:
        """The shell copied the staging into the waiter's dest (after `may_write` said yes)."""
        invariant(
            self.may_write(load_id, generation, dest_id), "delivered without a live Deliver", load_id=load_id
        )
        return self._end(load_id, "delivered")

    def shared_transfer(self, load_id: LoadId) -> TransferId | None:
        """The transfer live waiter `load_id` waits on, when other loads wait on it too (a
        query: nothing changes)."""
        waiter = self._waiters.get(load_id)
        if waiter is None:
            return None
        transfer = self._transfers.get(waiter.transfer_id)
        return waiter.transfer_id if transfer is not None and len(transfer.waiters) > 1 else None

    def cancel(self, load_id: LoadId) -> list[Effect]:
        """The engine gives up on `load_id`; its dest is the engine's again at once. A load that
        already ended (a race with its outcome) is counted and ignored."""
        if load_id not in self._waiters:
            self._count("cancel_unknown_total")
            return []
        return self._end(load_id, "cancelled")

    def expire(self, now_ms: int) -> list[Effect]:
        """Fail every waiter whose deadline is `<= now_ms` with "timeout"."""
        self._advance(now_ms)
        effects: list[Effect] = []
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            _, seq, load_id = heapq.heappop(self._deadlines)
            waiter = self._waiters.get(load_id)
            if waiter is None or waiter.seq != seq:
                continue  # ended before its deadline
            effects.append(Fail(load_id, TIMEOUT))
            effects += self._end(load_id, f"failed_{TIMEOUT}")
        return effects

    def forget_dest(self, dest_id: DestId) -> None:
        """Drop the generation remembered for `dest_id` when no live waiter holds it. For callers
        whose buffers are anonymous (never named again): keeps the table bounded. Never call it
        for a dest that a late completion could still name with a reused generation."""
        if dest_id not in self._dest_holder:
            self._dest_generation.pop(dest_id, None)

    # ---- fence -------------------------------------------------------------------------------

    def may_write(self, load_id: LoadId, generation: RequestGeneration, dest_id: DestId) -> bool:
        """May the shell copy into `dest_id` for this waiter now? Only for a DELIVERING waiter,
        named with its own generation and dest, which is the dest's current generation."""
        waiter = self._waiters.get(load_id)
        ok = (
            waiter is not None
            and waiter.delivering
            and waiter.generation == generation
            and waiter.dest_id == dest_id
            and self._dest_generation.get(dest_id) == generation
        )
        if not ok:
            self._count("writes_fenced_total")
        return ok

    # ---- plumbing ----------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _advance(self, now_ms: int) -> None:
        invariant(now_ms >= self._now_ms, "time went backwards", now_ms=now_ms, last_ms=self._now_ms)
        self._now_ms = now_ms

    def _busy_cause(self, size_bytes: int) -> str | None:
        if self.transfers_held >= self.transfers_max:
            return "transfers"
        if self.inflight_bytes_max is not None and self._held_bytes + size_bytes > self.inflight_bytes_max:
            return "bytes"
        return None

    def _end(self, load_id: LoadId, outcome: str, *, answered: bool = False) -> list[Effect]:
        """Forget a live waiter; if it was the last of its transfer, cancel or release that.
        `answered`: the transport has answered the transfer (it no longer writes into staging)."""
        waiter = self._waiters.pop(load_id)
        self._count(f"waiters_{outcome}_total")
        del self._dest_holder[waiter.dest_id]
        transfer = self._transfers[waiter.transfer_id]
        del transfer.waiters[load_id]
        if transfer.waiters:
            return []
        del self._transfers[waiter.transfer_id]
        del self._by_object[transfer.object_id]
        if transfer.state == "fetching" and not answered:
            self._cancelled[waiter.transfer_id] = transfer.size_bytes
            self._count("transfers_cancelled_total")
            return [CancelTransfer(waiter.transfer_id)]
        self._held_bytes -= transfer.size_bytes
        return [ReleaseStaging(waiter.transfer_id)]

    def check_invariants(self) -> None:
        attached = 0
        for transfer_id, transfer in self._transfers.items():
            invariant(transfer.waiters, "live transfer without waiters", transfer_id=transfer_id)
            invariant(self._by_object.get(transfer.object_id) == transfer_id, "object index drifted")
            invariant(transfer_id not in self._cancelled, "transfer both live and cancelled")
            for load_id in transfer.waiters:
                waiter = self._waiters.get(load_id)
                invariant(waiter is not None and waiter.transfer_id == transfer_id, "waiter detached")
                assert waiter is not None
                invariant(
                    waiter.delivering == (transfer.state == "delivering"),
                    "waiter state differs from its transfer",
                    load_id=load_id,
                )
            attached += len(transfer.waiters)
        invariant(attached == len(self._waiters), "a waiter is attached to no or two transfers")
        invariant(len(self._by_object) == len(self._transfers), "object index drifted")
        invariant(len(self._dest_holder) == len(self._waiters), "a dest is held by two waiters")
        for load_id, waiter in self._waiters.items():
            invariant(self._dest_holder.get(waiter.dest_id) == load_id, "dest holder drifted")
            invariant(self._dest_generation[waiter.dest_id] == waiter.generation, "waiter generation is old")
        invariant(self.transfers_held <= self.transfers_max, "too many transfers held")
        sizes = [t.size_bytes for t in self._transfers.values()] + list(self._cancelled.values())
        invariant(sum(sizes) == self._held_bytes, "held bytes drifted", held_bytes=self._held_bytes)
        invariant(
            self.inflight_bytes_max is None or self._held_bytes <= self.inflight_bytes_max,
            "too many bytes held",
        )

"""The one shape every protocol core shares: `step(event, now_ms) -> effects` (issue 26).

A core is a synchronous, I/O-free state machine. Its shell (the imperative part: NATS, sockets,
disks, tasks) feeds it one event at a time through `step`, with the time, and performs what
comes back. What `step` promises, for every core that has it (`Core`):

- Time is passed in, never read: `now_ms` is the shell's clock in integer milliseconds (each
  shell says which clock: `kvfabric.format.clock`). It never goes backwards: a `step` with an
  earlier `now_ms` than a `step` before it is a shell bug and raises `InvariantViolation` before
  anything changes. (Times given through the methods directly are checked where the method
  checks them; some cores, e.g. `SlotTable` and `DirectoryCore`, remember only `step`'s.)
- Effects come back in the order the shell must perform them (a list; empty when there is
  nothing to do). The core has already moved to its next state: the results of what the shell
  performs come back later as events of their own.
- No I/O: `step` does not sleep, block, log, read a clock or touch the network or a disk. It
  raises only what the method it stands for raises (an operating error such as `NotFound` for
  a request the core refuses, or `InvariantViolation` for a bug).
- `check_invariants()` holds after every step (tests call it after each one).

Each core's events are frozen, slotted dataclasses, one per entry point, in a sibling module
`<core>_events.py` (with a union alias of them and the `dispatch` that `step` calls); each is the
method of the same meaning, which existing callers may still call directly. `Tick` is the one
event every core with something to do as time passes understands ("time passed": its `tick`,
`expire` or `expire_writes`).

Replies. Some entry points answer their caller with a value instead of (or besides) effects: an
allocator's slot, a read grant, a routing decision, whether a copy was still wanted. `step`
returns such an answer as one `Reply(value)`, the last element of the list, for every event whose
method returns something other than effects (also when the value is None or False); an event
whose method returns nothing has no `Reply`. A shell performs its effects and hands the `Reply`
to whoever fed the event (`reply_of`). The shell driver (`kvfabric.runtime.core_driver`) runs any
core of this shape: it reads the clock, steps, performs the effects in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvfabric.format.invariant import invariant

__all__ = ["Core", "Reply", "Tick", "not_before", "reply_of"]

T = TypeVar("T")
EventT_contra = TypeVar("EventT_contra", contravariant=True)
EffectT_co = TypeVar("EffectT_co", covariant=True)


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: the core does what is due by `now_ms` (timeouts, budgets, retries)."""


@dataclass(frozen=True)  # not slotted: `Reply[int](1)` fails on a slotted frozen generic (3.11)
class Reply(Generic[T]):
    """The answer of an entry point that returns a value (a slot, a grant, a decision, a flag):
    the last element of the step's list, given to whoever fed the event; nothing to perform."""

    value: T


class Core(Protocol[EventT_contra, EffectT_co]):
    """What a shell driver needs of a core: one entry for events and time, and its invariants."""

    def step(self, event: EventT_contra, now_ms: int) -> Sequence[EffectT_co]:
        """Apply `event` at `now_ms` (never earlier than a time already given) and return the
        effects to perform, in order; an answer, if the event has one, as the last `Reply`."""
        ...

    def check_invariants(self) -> None:
        """Raise `InvariantViolation` when the core's state is inconsistent."""
        ...


def not_before(last_ms: int, now_ms: int) -> int:
    """`now_ms`, checked not to be before `last_ms` (the latest time the core was given): time
    going backwards is a shell bug (`InvariantViolation`)."""
    invariant(now_ms >= last_ms, "time went backwards", now_ms=now_ms, last_ms=last_ms)
    return now_ms


def reply_of(effects: Iterable[object]) -> object:
    """The answer among a step's effects: the value of its one `Reply` (an invariant)."""
    replies = [e for e in effects if isinstance(e, Reply)]
    invariant(len(replies) == 1, "a step answers with exactly one Reply here", replies=len(replies))
    return replies[0].value

"""Shared by the `step` tests (issue 26: one shape for every core): two cores built alike, one
driven through `step(event, now_ms)`, one through the methods `by_method` calls for each event,
given the same random run, must answer the same (effects, replies, or the same error) and end
every step in the same state, compared whole (`snapshot`: every attribute, recursively; only
`_step_ms`, the time `step` saw, is `step`'s own)."""

from __future__ import annotations

import array
import enum
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pytest
from hypothesis import strategies as st

from kvfabric.format.invariant import InvariantViolation

STEP_OWN = frozenset({"_step_ms"})
PLAIN = frozenset({int, float, str, bytes, bool, type(None)})
DELTAS_MS = (0, 0, 1, 7, 30, 120, 900)


class Stepped(Protocol):
    def step(self, event: Any, now_ms: int) -> Sequence[object]: ...

    def check_invariants(self) -> None: ...


def snapshot(x: object, seen: set[int] | None = None) -> object:
    """A comparable copy of everything `x` holds (objects by their attributes)."""
    seen = set() if seen is None else seen
    if x is None or isinstance(x, bool | int | float | str | bytes | enum.Enum):
        return x
    if isinstance(x, bytearray | memoryview | array.array):
        return bytes(x)
    if isinstance(x, list | tuple | deque):
        if PLAIN.issuperset(map(type, x)):  # fast: a sketch's counters are long lists of ints
            return (type(x).__name__, tuple(x))
        return (type(x).__name__, tuple(snapshot(i, seen) for i in x))
    if isinstance(x, dict):
        return (type(x).__name__, tuple((snapshot(k, seen), snapshot(v, seen)) for k, v in x.items()))
    if isinstance(x, set | frozenset):
        return (type(x).__name__, frozenset(snapshot(i, seen) for i in x))
    if id(x) in seen:
        return ("seen", type(x).__qualname__)
    seen.add(id(x))
    fields: dict[str, object] = {}
    for cls in type(x).__mro__:
        slots = getattr(cls, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__weakref__", "__dict__") and hasattr(x, name):
                fields[name] = getattr(x, name)
    fields.update(getattr(x, "__dict__", {}))
    return (
        type(x).__qualname__,
        tuple((k, snapshot(v, seen)) for k, v in sorted(fields.items()) if k not in STEP_OWN),
    )


def outcome(call: Callable[[], Sequence[object]]) -> tuple[object, ...]:
    try:
        return ("ok", list(call()))
    except Exception as exc:  # the same error, whichever way the core was called
        return ("raised", type(exc).__name__, str(exc))


def run_both(
    data: st.DataObject,
    make: Callable[[], Stepped],
    draw_event: Callable[[st.DataObject, list[object], Any], object],
    by_method: Callable[[Any, Any, int], Sequence[object]],
    steps_max: int = 60,
    steps_min: int = 1,
) -> int:
    """One random run through both cores; returns the steps taken. `draw_event` sees what came
    out so far (effects and replies: ids to answer) and the stepped core (to read, not to change);
    `steps_min`: for a protocol that needs a few steps in a row to get anywhere (a write)."""
    stepped, called = make(), make()
    now, out = 0, list[object]()
    steps = data.draw(st.integers(min_value=steps_min, max_value=steps_max))
    for n in range(steps):
        now += data.draw(st.sampled_from(DELTAS_MS))
        event = draw_event(data, out, stepped)
        a = outcome(lambda: stepped.step(event, now))  # noqa: B023 - called at once
        b = outcome(lambda: by_method(called, event, now))  # noqa: B023
        assert a == b, (event, a, b)
        assert snapshot(stepped) == snapshot(called), event
        if a[0] == "raised" and a[1] == InvariantViolation.__name__:
            return n + 1  # a caller's bug for this core: both refused it alike; the run ends
        stepped.check_invariants()
        if a[0] == "ok":
            out.extend(a[1])  # type: ignore[arg-type]
    return steps


def backwards_refused(core: Stepped, first: object, second: object, now_ms: int = 1_000) -> None:
    """`second` at a time before `first`'s is refused (InvariantViolation), changing nothing."""
    core.step(first, now_ms)
    before = snapshot(core)
    with pytest.raises(InvariantViolation, match="time went backwards"):
        core.step(second, now_ms - 1)
    assert snapshot(core) == before
    core.step(second, now_ms)  # the same time again is fine

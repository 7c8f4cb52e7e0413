"""`invariant()`: a check that survives `python -O`.

An invariant violation is a programmer error, not an operating error: it raises
`InvariantViolation`, which services log once and then exit non-zero on. Never catch it to
carry on.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["InvariantViolation", "invariant", "unreachable"]


class InvariantViolation(AssertionError):
    """Something that must never happen happened. A bug: crash, do not handle."""


def invariant(condition: object, message: str, /, **context: object) -> None:
    """Raise `InvariantViolation` unless `condition` holds. Unlike `assert`, never stripped."""
    if not condition:
        detail = " ".join(f"{k}={v!r}" for k, v in context.items())
        raise InvariantViolation(f"{message} {detail}".rstrip())


def unreachable(message: str, /, **context: object) -> NoReturn:
    """Mark a branch that must never run."""
    invariant(False, message, **context)
    raise AssertionError("unreachable")  # pragma: no cover - invariant always raised above

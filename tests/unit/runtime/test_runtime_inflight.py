"""The in-flight limit: take a slot or refuse at once; never queue, never go below zero."""

from __future__ import annotations

import pytest

from kvfabric.format.invariant import InvariantViolation
from kvfabric.runtime.inflight import InflightLimiter


def test_fills_refuses_then_frees() -> None:
    limiter = InflightLimiter(2)
    assert [limiter.try_acquire() for _ in range(3)] == [True, True, False]
    assert (limiter.count, limiter.full, limiter.rejected_total) == (2, True, 1)

    limiter.release()
    assert not limiter.full
    assert limiter.try_acquire()
    assert not limiter.try_acquire()
    assert (limiter.count, limiter.rejected_total) == (2, 2)


def test_refusal_does_not_take_a_slot() -> None:
    limiter = InflightLimiter(1)
    assert limiter.try_acquire()
    for _ in range(100):
        assert not limiter.try_acquire()
    limiter.release()
    assert limiter.count == 0


def test_release_without_acquire_is_a_bug() -> None:
    limiter = InflightLimiter(1)
    with pytest.raises(InvariantViolation, match="release without acquire"):
        limiter.release()


def test_limit_must_be_positive() -> None:
    with pytest.raises(InvariantViolation):
        InflightLimiter(0)

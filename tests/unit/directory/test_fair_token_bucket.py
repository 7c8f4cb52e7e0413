"""`kvfabric.core.quotas.TokenBucket`, the one token bucket (issue 26 item 5): the directory's
quotas, fair admission, give-back budget and shard-map / suspect rates all use it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.core.quotas import TokenBucket
from kvfabric.directory import admission, shard_host


def test_take_refill_and_wait() -> None:
    bucket = TokenBucket.full(10.0, 5, now_s=0.0)
    assert bucket.take(5, 0.0) and not bucket.take(1, 0.0)  # a refusal takes nothing
    assert bucket.tokens == 0 and bucket.wait_s(2, 0.0) == pytest.approx(0.2)
    assert bucket.level(0.1) == pytest.approx(1.0) and bucket.tokens == 0  # level changes nothing
    assert bucket.take(1, 0.1) and bucket.full_at_s() == pytest.approx(0.6)
    assert bucket.level(100.0) == 5  # capped at its capacity


def test_time_only_moves_forward() -> None:
    bucket = TokenBucket.full(10.0, 5, now_s=1.0)
    assert bucket.take(5, 1.0)
    assert bucket.refill(0.5) == 0 and bucket.updated_s == 1.0  # an older time refills nothing


def test_a_charge_may_leave_a_debt_down_to_its_floor() -> None:
    bucket = TokenBucket.full(10.0, 5, now_s=0.0)
    bucket.charge(8, 0.0, floor=-5)
    assert bucket.tokens == -3 and bucket.wait_s(1, 0.0) == pytest.approx(0.4)
    bucket.charge(100, 0.0, floor=-5)
    assert bucket.tokens == -5
    bucket.charge(100, 0.0)  # the default floor never raises a debt
    assert bucket.tokens == -5
    bucket.check(floor=-5)


@given(st.lists(st.tuples(st.floats(0, 2), st.integers(0, 12)), max_size=40))
def test_taken_over_any_window_is_at_most_burst_plus_rate(ops: list[tuple[float, int]]) -> None:
    rate, burst = 10.0, 5
    bucket = TokenBucket.full(rate, burst, now_s=0.0)
    now, taken = 0.0, 0
    for step, n in ops:
        now += step
        if bucket.take(n, now):
            taken += n
        bucket.check()
        assert taken <= burst + rate * now + 1e-6


def test_the_directorys_buckets_are_this_one() -> None:
    assert vars(admission)["TokenBucket"] is TokenBucket and vars(shard_host)["TokenBucket"] is TokenBucket
    assert "_Bucket" not in vars(shard_host)

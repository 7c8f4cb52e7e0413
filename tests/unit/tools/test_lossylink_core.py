"""The lossy link's schedule (tools/lossylink_core.py) on a fake clock: every release time is
computed from arrivals we choose, no sleeps, no devices."""

from __future__ import annotations

import pytest

from tests.unit.tools.toolkit import load_tool

core = load_tool("lossylink_core")
LinkSchedule, LinkDirection, LinkQueue = core.LinkSchedule, core.LinkDirection, core.LinkQueue


def run(
    schedule: object, arrivals_ms: list[float], size: int = 1500, seed: str = "t"
) -> list[tuple[float, ...]]:
    d = LinkDirection(schedule, seed)
    return [d.offer(size, t) for t in arrivals_ms]


def test_a_perfect_link_releases_every_packet_at_once_in_order() -> None:
    out = run(LinkSchedule(), [0.0, 0.5, 0.5, 3.0])
    assert out == [(0.0,), (0.5,), (0.5,), (3.0,)]


def test_fixed_delay_shifts_every_packet() -> None:
    assert run(LinkSchedule(delay_ms=200), [0.0, 1.0, 10.0]) == [(200.0,), (201.0,), (210.0,)]


@pytest.mark.parametrize("gap_ms", [0.1, 5.0, 50.0])  # 10 kpps, 200 pps, 20 pps
def test_jitter_stays_in_its_bounds_spans_them_and_never_reorders(gap_ms: float) -> None:
    arrivals = [i * gap_ms for i in range(int(60_000 / gap_ms))]  # one minute of packets
    out = [t for (t,) in run(LinkSchedule(delay_ms=200, jitter_ms=20), arrivals)]
    delays = [r - a for r, a in zip(out, arrivals, strict=True)]
    assert all(180.0 - 1e-9 <= x <= 220.0 + 1e-9 for x in delays)
    assert min(delays) < 181.0 and max(delays) > 219.0
    assert sum(delays) / len(delays) == pytest.approx(200.0, abs=3.0)
    assert out == sorted(out)  # the offset slews slower than time passes: no overtaking


def test_jitter_larger_than_the_delay_is_clipped_at_zero() -> None:
    out = run(LinkSchedule(delay_ms=5, jitter_ms=50), [float(i * 100) for i in range(1000)])
    assert all(r >= a for (r,), a in zip(out, [i * 100 for i in range(1000)], strict=True))


@pytest.mark.parametrize("loss_p", [0.01, 0.05, 0.3])
def test_independent_loss_matches_the_configured_rate(loss_p: float) -> None:
    n = 100_000
    out = run(LinkSchedule(loss_p=loss_p), [float(i) for i in range(n)])
    measured = sum(not x for x in out) / n
    assert abs(measured - loss_p) < 0.005
    assert core.expected_loss_p(LinkSchedule(loss_p=loss_p)) == pytest.approx(loss_p)


def test_the_same_seed_drops_the_same_packets_and_another_seed_others() -> None:
    arrivals = [float(i) for i in range(2_000)]
    s = LinkSchedule(loss_p=0.1, delay_ms=10, jitter_ms=5)
    assert run(s, arrivals, seed="a") == run(s, arrivals, seed="a")
    assert run(s, arrivals, seed="a") != run(s, arrivals, seed="b")


def bursts(out: list[tuple[float, ...]]) -> list[int]:
    """Lengths of the runs of consecutive lost packets."""
    runs, current = [], 0
    for x in out:
        if not x:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs


def test_gilbert_elliott_loss_comes_in_bursts_of_the_configured_mean_length() -> None:
    n = 200_000
    s = core.bursty(0.05, 4.0)
    assert core.expected_loss_p(s) == pytest.approx(0.05)
    out = run(s, [float(i) for i in range(n)])
    assert abs(sum(not x for x in out) / n - 0.05) < 0.005
    runs = bursts(out)
    assert sum(runs) / len(runs) == pytest.approx(4.0, rel=0.1)
    # independent loss at the same rate: bursts of ~1 / (1 - p) = 1.05 packets
    flat = bursts(run(LinkSchedule(loss_p=0.05), [float(i) for i in range(n)]))
    assert sum(flat) / len(flat) < 1.1


def test_gilbert_elliott_with_loss_in_both_states() -> None:
    s = LinkSchedule(ge_p=0.02, ge_r=0.2, ge_loss_bad_p=0.5, ge_loss_good_p=0.01)
    bad = 0.02 / 0.22
    assert core.expected_loss_p(s) == pytest.approx(bad * 0.5 + (1 - bad) * 0.01)
    n = 200_000
    out = run(s, [float(i) for i in range(n)])
    assert abs(sum(not x for x in out) / n - core.expected_loss_p(s)) < 0.005


def test_independent_and_bursty_loss_combine() -> None:
    s = LinkSchedule.from_dict({"loss_p": 0.02, "bursty": {"loss_p": 0.03, "burst_packets": 3}})
    assert core.expected_loss_p(s) == pytest.approx(1 - 0.98 * 0.97)
    n = 200_000
    out = run(s, [float(i) for i in range(n)])
    assert abs(sum(not x for x in out) / n - core.expected_loss_p(s)) < 0.005


def test_reordered_packets_skip_the_delay_and_overtake_those_in_flight() -> None:
    n = 20_000
    d = LinkDirection(LinkSchedule(delay_ms=50, reorder_p=0.1), "r")
    out = [d.offer(100, float(i)) for i in range(n)]  # one packet per ms, 50 in flight
    released = [t for (t,) in out]
    overtaking = sum(r == a for r, a in zip(released, range(n), strict=True))
    assert d.stats.reordered == overtaking
    assert abs(overtaking / n - 0.1) < 0.01
    order = [i for _, i in sorted((t, i) for i, t in enumerate(released))]
    assert order != list(range(n))  # delivered out of order
    others = [t for t, a in zip(released, range(n), strict=True) if t != a]
    assert others == sorted(others) and all(
        t - a == 50 for t, a in zip(released, range(n), strict=True) if t != a
    )


def test_duplicated_packets_leave_twice_at_the_same_time() -> None:
    n = 50_000
    d = LinkDirection(LinkSchedule(delay_ms=1, duplicate_p=0.02), "d")
    out = [d.offer(100, float(i)) for i in range(n)]
    twice = [x for x in out if len(x) == 2]
    assert all(x[0] == x[1] for x in twice)
    assert len(twice) == d.stats.duplicated
    assert abs(len(twice) / n - 0.02) < 0.003


def test_the_rate_cap_serialises_packets_and_drops_past_its_queue_bound() -> None:
    # 150,000 bytes/s: a 1500-byte packet takes 10 ms on the wire
    d = LinkDirection(LinkSchedule(rate_bytes_per_s=150_000, queue_ms_max=45), "c")
    out = [d.offer(1500, 0.0) for _ in range(8)]  # a burst at t = 0
    assert out[:5] == [(10.0,), (20.0,), (30.0,), (40.0,), (50.0,)]
    assert out[5:] == [(), (), ()]  # would wait 50, 60, 70 ms > 45 ms
    assert d.stats.queue_dropped == 3 and d.stats.lost == 0
    assert d.offer(1500, 100.0) == (110.0,)  # the queue drained meanwhile


def test_rate_cap_and_delay_add_up() -> None:
    d = LinkDirection(LinkSchedule(rate_bytes_per_s=1_000_000, delay_ms=100), "cd")
    assert d.offer(1000, 0.0) == (101.0,)
    assert d.offer(1000, 0.0) == (102.0,)


def test_a_new_schedule_applies_to_later_packets_and_clears_the_bad_state() -> None:
    d = LinkDirection(LinkSchedule(delay_ms=200, ge_p=1.0, ge_r=0.01), "s")
    assert d.offer(100, 0.0) == ()  # straight into the bad state
    d.set_schedule(LinkSchedule())
    assert not d.bad
    assert d.offer(100, 1.0) == (1.0,)
    d2 = LinkDirection(LinkSchedule(delay_ms=200), "s2")
    assert d2.offer(100, 0.0) == (200.0,)
    d2.set_schedule(LinkSchedule())
    assert d2.offer(100, 1.0) == (200.0,)  # in order: not before the packet ahead of it
    assert d2.offer(100, 300.0) == (300.0,)


def test_the_queue_releases_by_time_then_arrival_and_is_bounded() -> None:
    q = LinkQueue(in_flight_packets_max=3)
    assert q.push(20.0, 1, b"b") and q.push(10.0, 0, b"a") and q.push(20.0, 1, b"c")
    assert not q.push(5.0, 0, b"d") and q.overflow_dropped == 1
    assert q.next_release_ms() == 10.0
    assert q.pop_due(9.9) == []
    assert q.pop_due(10.0) == [(0, b"a")]
    assert q.pop_due(25.0, count_max=1) == [(1, b"b")]
    assert q.pop_due(25.0) == [(1, b"c")]
    assert q.next_release_ms() is None and len(q) == 0


def test_a_fake_clock_walk_through_direction_and_queue() -> None:
    """The forwarder's loop on a fake clock: arrivals every 1 ms, 30 ms delay, 10% loss; at each
    tick what is due comes out, in order, exactly 30 ms after it came in."""
    d = LinkDirection(LinkSchedule(delay_ms=30, loss_p=0.1), "walk")
    q = LinkQueue()
    delivered: list[tuple[float, bytes]] = []
    for now in range(200):
        if now < 100:
            for t in d.offer(10, float(now)):
                q.push(t, 0, now.to_bytes(2, "big"))
        delivered += [(float(now), p) for _, p in q.pop_due(float(now))]
    sent = [int.from_bytes(p, "big") for _, p in delivered]
    assert sent == sorted(sent) and len(sent) == 100 - d.stats.lost
    assert all(at - s == 30 for (at, _), s in zip(delivered, sent, strict=True))


@pytest.mark.parametrize(
    "bad",
    [{"loss_p": 1.5}, {"delay_ms": -1}, {"ge_p": 0.1, "ge_r": 0.0}, {"duplicate_p": -0.1}, {"nonsense": 1}],
)
def test_invalid_schedules_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="link schedule"):
        LinkSchedule.from_dict(bad)


def test_describe_and_round_trip() -> None:
    s = LinkSchedule(delay_ms=200, jitter_ms=20, loss_p=0.05)
    assert s.describe() == "delay 200±20 ms, loss 5%"
    assert LinkSchedule.from_dict(s.to_dict()) == s
    assert LinkSchedule().describe() == "clear"

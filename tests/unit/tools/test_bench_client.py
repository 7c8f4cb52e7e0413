"""The pure parts of `python -m bench.client`: statistics, points, verdicts (the benchmark itself is
not run here)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.client import (
    MiB,
    Point,
    aggregate_gbps,
    bytes_problems,
    mooncake_kind,
    mooncake_points,
    percentile,
    prompts_per_run,
    verdicts,
    working_prompts,
)
from bench.client_worker import Outcome

KiB = 1 << 10


def test_aggregate_gbps_is_all_bytes_over_first_start_to_last_end() -> None:
    # two engines: 1 GB in [0, 1] s and 1 GB in [0.5, 2] s -> 2 GB in 2 s
    assert aggregate_gbps([(0.0, 1.0, 10**9), (0.5, 2.0, 10**9)]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no time"):
        aggregate_gbps([(1.0, 1.0, 10)])


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 51.0  # round(0.5 × 99) = 50 (banker's rounding: 49.5 -> 50)
    assert percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0


def test_measurement_and_working_set_sizes() -> None:
    assert prompts_per_run(256 * KiB, 64 * MiB) == 32
    assert prompts_per_run(16 * MiB, 64 * MiB) == 1  # at least one prompt
    assert working_prompts(256 * KiB, 512 * MiB, 4, 64 * MiB) == 256
    # 16 MiB: 512 MiB is 4 prompts, and 4 engines × 1 prompt need 4 distinct ones
    assert working_prompts(16 * MiB, 512 * MiB, 4, 64 * MiB) == 4
    assert working_prompts(16 * MiB, 128 * MiB, 4, 64 * MiB) == 4


def outcome(t0: float, t1: float, nbytes: int, **kw: Any) -> Outcome:
    return Outcome(t0=t0, t1=t1, nbytes=nbytes, lat_s=[t1 - t0], **kw)


def test_point_reports_the_median_run_and_pooled_latency() -> None:
    p = Point("kvfabric remote", "load", "remote:load", MiB, 1, prompts=1)
    for seconds in (1.0, 2.0, 4.0):
        p.add([outcome(0.0, seconds, 10**9, verified=8)])
    r = p.record()
    assert r["gbps"] == 0.5  # runs 1.0, 0.5, 0.25 GB/s
    assert r["gbps_runs"] == [1.0, 0.5, 0.25]
    assert r["p50_ms"] == 2000.0 and r["p99_ms"] == 4000.0
    assert r["verified"] == 24 and r["error"] == ""


def test_a_mismatch_or_a_short_load_leaves_no_throughput() -> None:
    p = Point("kvfabric co-located", "load", "local:load", MiB, 4, prompts=1)
    p.add([outcome(0.0, 1.0, 10**9, verified=8), outcome(0.0, 1.0, 10**9, verified=8, mismatches=1)])
    p.add([outcome(0.0, 1.0, 10**9, short=2, causes={"checksum": 2})])
    r = p.record()
    assert r["gbps"] is None and r["runs"] == 2
    assert r["mismatches"] == 1 and r["short"] == 2
    assert "1 mismatches, 2 chunks short (checksum 2)" in r["error"]
    assert bytes_problems([r]) == [f"kvfabric co-located load 1 MiB ×4: {r['error']}"]


def test_a_failed_call_stops_the_point() -> None:
    p = Point("kvfabric remote", "save", "remote:save", MiB, 1, prompts=1)
    p.add([outcome(0.0, 1.0, 10**9)])
    p.add([Outcome(error="Busy: too many data connections")])
    r = p.record()
    assert r["gbps"] is None and "Busy" in r["error"]


def point(kind: str, size: int, engines: int, gbps: float | None) -> dict[str, Any]:
    return {"kind": kind, "size": size, "engines": engines, "gbps": gbps, "error": ""}


def test_verdicts_hold_only_when_every_size_meets_the_target() -> None:
    sizes = [MiB, 4 * MiB]
    get_into = mooncake_kind("remote", "batch_get_into")
    points = [
        point("remote:lookup_load_release", MiB, 1, 2.0),
        point(get_into, MiB, 1, 1.0),
        point("remote:lookup_load_release", 4 * MiB, 1, 0.9),
        point(get_into, 4 * MiB, 1, 1.0),
        point("remote:load", MiB, 1, 0.8),
        point("tcp_get", MiB, 1, 1.0),
        point("remote:load", 4 * MiB, 1, 0.85),
        point("tcp_get", 4 * MiB, 1, 1.0),
        point("local:load", MiB, 1, 1.0),
        point("local:load", MiB, 4, 1.5),
        point("local:load", 4 * MiB, 1, 1.0),
        point("local:load", 4 * MiB, 4, None),  # mismatches: no throughput
    ]
    by_target = {v["target"]: v for v in verdicts(points, sizes, [1, 4])}
    llr = by_target["remote lookup+load+release ≥ 1.0 × Mooncake remote batch_get_into"]
    assert not llr["met"] and llr["worst"] == 0.9 and "missed at 4 MiB" in llr["detail"]
    load = by_target["remote load ≥ 0.8 × transport get, tcp"]
    assert load["met"] and load["ratios"] == {str(MiB): 0.8, str(4 * MiB): 0.85}
    local = by_target["co-located load ≥ 0.7 × transport get, shm"]
    assert not local["met"] and local["detail"] == "not measured"
    scaling = by_target["4 engines ≥ 1 engine, co-located load"]
    assert not scaling["met"] and "not measured at 4 MiB" in scaling["detail"]
    assert scaling["ratios"][str(MiB)] == 1.5


def test_mooncake_points_without_verified_bytes_or_tcp_have_no_throughput() -> None:
    result = {
        "procs": 4,
        "points": [
            {"size": MiB, "op": "batch_get_into", "gbps": 1.4, "p50_ms": 5.0, "p99_ms": 9.0,
             "errors": 0, "mismatches": 0, "verified": 64, "tcp": {"ok": True, "lo_ratio": 1.03}},
            {"size": MiB, "op": "batch_put_from", "gbps": 1.2, "p50_ms": 5.0, "p99_ms": 9.0,
             "errors": 0, "mismatches": 0, "verified": 0, "tcp": {"ok": False, "lo_ratio": 0.01}},
            {"size": 4 * MiB, "op": "batch_get_into", "gbps": 1.5, "p50_ms": 5.0, "p99_ms": 9.0,
             "errors": 0, "mismatches": 3, "verified": 64, "tcp": {"ok": True, "lo_ratio": 1.02}},
        ],
    }  # fmt: skip
    points = mooncake_points(result, "remote")
    assert [(p["kind"], p["engines"], p["gbps"]) for p in points] == [
        (mooncake_kind("remote", "batch_get_into"), 4, 1.4),
        (mooncake_kind("remote", "batch_put_from"), 4, None),
        (mooncake_kind("remote", "batch_get_into"), 4, None),
    ]
    assert "TCP check failed" in points[1]["error"] and "3 mismatches" in points[2]["error"]
    assert bytes_problems(points) == []  # the peer's problems are reported, not ours to fail on

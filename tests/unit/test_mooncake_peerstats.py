"""The Mooncake peer's pure parts (bench/peerstats.py) and bench.mooncake's refusals; no Mooncake needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import mooncake
from bench.peerstats import (
    DEFAULT_SIZES,
    OPS,
    GiB,
    KiB,
    MiB,
    PassRecord,
    median,
    parse_args,
    peer_argv,
    percentile,
    plan,
    run_gbps,
    summarize,
    table,
    tcp_verdict,
)


def rec(
    start_ns: int, end_ns: int, payload: int, calls: tuple[int, ...] = (1,), errors: int = 0
) -> PassRecord:
    return PassRecord(start_ns, end_ns, payload, calls, errors, mismatches=0, verified=0)


def test_defaults_are_the_briefed_benchmark() -> None:
    a = parse_args([])
    assert (a.sizes, a.objects, a.repeats, a.mode, a.procs) == (list(DEFAULT_SIZES), 8, 5, "remote", 1)
    assert a.sizes == [262144, 1048576, 4194304, 16777216]
    assert a.working_set_bytes == GiB and a.json_path is None


def test_what_measure_passes_is_read_back_unchanged() -> None:
    argv = peer_argv([4096, 2 * MiB], 3, 7, "local", 4, 64 * MiB, "/tmp/x.json", 99)
    a = parse_args(argv)
    assert (a.sizes, a.objects, a.repeats, a.mode, a.procs) == ([4096, 2 * MiB], 3, 7, "local", 4)
    assert (a.working_set_bytes, a.json_path, a.timeout_s) == (64 * MiB, "/tmp/x.json", 99)


@pytest.mark.parametrize(
    "argv",
    [
        ["--procs", "0"],
        ["--procs", "9"],
        ["--mode", "rdma"],
        ["--sizes", "0"],
        ["--sizes", "1024,-5"],
        ["--sizes", ","],
        ["--sizes", str(65 * MiB)],
        ["--objects", "0"],
        ["--repeats", "0"],
        ["--working-set-bytes", str(5 * GiB)],
    ],
)
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_plan_fills_the_working_set_across_processes() -> None:
    assert plan(256 * KiB, 8, 1, GiB) == 512  # 512 prompts of 2 MiB
    assert plan(16 * MiB, 8, 1, GiB) == 8
    assert plan(16 * MiB, 8, 4, GiB) == 2  # 4 processes x 2 prompts x 128 MiB = 1 GiB
    assert plan(16 * MiB, 8, 4, 100 * MiB) == 1  # never less than one prompt


def test_percentile_is_nearest_rank_and_median_averages_the_middle() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert percentile([5.0], 0.99) == 5.0
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_aggregate_gbps_spans_first_start_to_last_end() -> None:
    # Two processes, 1 GB each; they overlap: 2 GB over 2 s (not 2 x 1 GB/s, not 2 GB / 1.5 s).
    records = [rec(0, 1_500_000_000, 10**9), rec(500_000_000, 2_000_000_000, 10**9)]
    assert run_gbps(records) == pytest.approx(1.0)
    assert run_gbps([rec(0, 10**9, 3 * 10**9)]) == pytest.approx(3.0)


def test_summarize_takes_the_median_repeat_and_pools_call_latencies() -> None:
    ms = 1_000_000
    runs = [
        [rec(0, 10**9, 10**9, calls=(1 * ms, 2 * ms))],  # 1 GB/s
        [rec(0, 10**9 // 4, 10**9, calls=(3 * ms, 4 * ms))],  # 4 GB/s
        [rec(0, 10**9 // 2, 10**9, calls=(5 * ms, 100 * ms))],  # 2 GB/s
    ]
    s = summarize(runs)
    assert s["gbps"] == 2.0 and s["gbps_runs"] == [1.0, 4.0, 2.0]
    assert (s["p50_ms"], s["p99_ms"], s["calls"]) == (3.0, 100.0, 6)  # of 1 2 3 4 5 100 ms
    assert (s["bytes_per_run"], s["errors"], s["mismatches"]) == (10**9, 0, 0)


def test_a_failed_call_voids_the_throughput() -> None:
    s = summarize([[rec(0, 10**9, 10**9)], [rec(0, 10**9, 10**9, errors=1)]])
    assert s["gbps"] is None and s["errors"] == 1 and s["gbps_runs"] == [1.0, 1.0]


def test_tcp_verdict_wants_payload_on_loopback_when_remote_and_none_when_local() -> None:
    assert tcp_verdict("remote", 1_003_000, 1_000_000)["ok"]
    assert not tcp_verdict("remote", 100_000, 1_000_000)["ok"]  # served in-process: not remote
    assert tcp_verdict("local", 600, 1_000_000)["ok"]
    assert not tcp_verdict("local", 1_000_000, 1_000_000)["ok"]  # crossed TCP: not local
    assert tcp_verdict("remote", 1_003_000, 1_000_000)["lo_ratio"] == 1.003


def test_table_has_a_row_per_op_and_marks_void_throughput() -> None:
    points = [
        {"size": s, "op": op, "gbps": None if op == "get_batch" else 1.5, "p50_ms": 2.0}
        for s in (256 * KiB, MiB)
        for op in OPS
    ]
    res = {
        "version": "v",
        "mode": "remote",
        "procs": 1,
        "sizes": [256 * KiB, MiB],
        "points": points,
        "tcp_check": {"ok": True, "min_lo_ratio": 1.0, "max_lo_ratio": 1.01},
        "errors": 0,
        "mismatches": 0,
        "verified": 10,
        "elapsed_s": 1.0,
    }
    lines = table(res).splitlines()
    assert "| 256 KiB | 1 MiB |" in lines[1]
    assert "| batch_get_into | 1.50 (2.00) | 1.50 (2.00) |" in lines
    assert "| get_batch | - (2.00) | - (2.00) |" in lines


def test_measure_says_why_it_cannot_run_instead_of_raising(tmp_path: Path) -> None:
    reason = mooncake.measure([MiB], python=tmp_path / "no-such-python")
    assert isinstance(reason, str) and "make mooncake-setup" in reason
    with pytest.raises(ValueError, match="mode"):
        mooncake.measure([MiB], mode="rdma", python=tmp_path / "no-such-python")

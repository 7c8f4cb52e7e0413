"""The pure parts of `python -m bench.ssd_tier`: paired ratios, the SSD get's bound, the targets,
the p99 figure and the table (the benchmark itself is not run here)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.ssd_tier import MiB, Row, extent_of, judge, markdown

SIZES = [MiB]


def _point(row: str, rounds: list[float]) -> dict[str, Any]:
    return {"row": row, "size": MiB, "gbps": sorted(rounds)[len(rounds) // 2], "rounds_gbps": rounds,
            "p50_ms": 1.0, "p99_ms": 2.0}  # fmt: skip


def _points(**overrides: list[float]) -> list[dict[str, Any]]:
    rows = {
        "raw write": [1.0, 0.2, 1.0],
        "tier write": [0.9, 0.18, 0.5],  # per round 0.9, 0.9, 0.5: median 0.9 (medians alone: 0.5 / 1.0)
        "raw read (write phase)": [1.0, 1.0, 1.0],
        "tier read": [0.5, 0.5, 0.5],
        "raw read": [1.0, 1.0, 1.0],
        "SSD get": [0.3, 0.3, 0.3],
        "DRAM get": [2.0, 2.0, 2.0],
        "fresh read buffer": [2.0, 2.0, 2.0],
        **overrides,
    }
    return [_point(name, rounds) for name, rounds in rows.items()]


P99 = {"size": MiB, "states": ["quiet", "writer"], "writer_p99_ratio": 1.05, "gets_per_window": 10,
       "windows_per_state": 2, "quiet_p50_ms": 1.0, "writer_p50_ms": 1.0, "quiet_p99_ms": 2.0,
       "writer_p99_ms": 2.1, "writer_gbps": 0.1, "writer_cpu_cores": 0.1,
       "demotion_pool_exhausted": False}  # fmt: skip


def test_ratios_pair_rounds_and_the_ssd_get_bound_composes_its_parts() -> None:
    by = {(v["check"], v["size"]): v for v in judge(_points(), SIZES, P99, {})}
    write = by[("tier write / raw write", MiB)]
    assert write["ratio"] == pytest.approx(0.9) and write["met"] is True
    get = by[("SSD get / raw read", MiB)]
    assert get["ratio"] == pytest.approx(0.3) and get["met"] is False
    assert get["bound_ratio"] == pytest.approx(1 / (1 / 1 + 1 / 2))  # read, then send: 0.67 of raw
    assert get["overlap_bound_ratio"] == pytest.approx(1.0)  # streamed: the slower part, the read
    assert by[("tier read / raw read (write phase)", MiB)]["met"] is None  # a part, no target
    assert by[("DRAM get p99 writer / quiet", MiB)]["met"] is True
    assert ("demotion / raw write (demotion phase)", MiB) not in by  # no demote verb: no row


def test_demotion_rows_are_judged_when_measured() -> None:
    points = _points(**{"raw write (demotion phase)": [1.0, 1.0, 1.0], "demotion": [0.7, 0.9, 0.75],
                        "SSD get (demoted)": [0.8, 0.8, 0.9]})  # fmt: skip
    by = {(v["check"], v["size"]): v for v in judge(points, SIZES, {**P99, "writer_p99_ratio": 1.2}, {})}
    assert by[("demotion / raw write (demotion phase)", MiB)]["ratio"] == pytest.approx(0.75)
    assert by[("demotion / raw write (demotion phase)", MiB)]["met"] is False
    assert by[("SSD get (demoted) / raw read", MiB)]["met"] is True
    assert by[("DRAM get p99 writer / quiet", MiB)]["met"] is False


def test_the_table_states_targets_and_the_bound() -> None:
    result = {
        "meta": {"date": "2026-12-01", "command": "python -m bench.ssd_tier", "machine": "vm", "cpus": 2,
                 "filesystem": "ext4", "elapsed_s": 60.0, "loadavg": (3.0, 2.0, 1.0)},
        "points": _points(),
        "p99": P99,
        "verdicts": judge(_points(), SIZES, P99, {}),
    }  # fmt: skip
    text = markdown(result, SIZES)
    assert "| SSD get / raw read | 1 MiB | 0.30 | >= 0.8 | NO | 0.67 of raw / 1.00 of raw |" in text
    assert "| tier write / raw write | 1 MiB | 0.90 | >= 0.8 | yes |" in text
    assert "p99 2.00 / 2.10 ms" in text


def test_rows_and_extents() -> None:
    row = Row()
    row.timed(4, MiB, lambda i: None)
    summary = row.summary()
    assert len(summary["rounds_gbps"]) == 1 and summary["p99_ms"] is not None
    assert extent_of(1) == 4096 and extent_of(8192) == 8192
    batches = Row()
    batches.rounds_gbps.append(1.0)
    assert batches.summary()["p50_ms"] is None

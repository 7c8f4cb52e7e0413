"""Pure helpers of the Mooncake Store peer (`bench/mooncake_peer.py`), stdlib only.

The peer runs in Mooncake's own venv (`.venv-mooncake`) and imports this module; the project's venv
imports it too (`bench/mooncake.py` builds the peer's command line with `peer_argv`, the unit tests
check the arithmetic). Nothing here does I/O.

- `parse_args`: the peer's command line, validated.
- `plan`: how many prompts (batch calls of `objects` keys) each client process puts and gets per pass
  so that all processes together touch about `working_set_bytes` per size.
- `summarize`: per-process pass records of the repeats → one point: GB/s per repeat (all bytes / (last
  end - first start)), their median, p50/p99 per batch call over all calls.
- `tcp_verdict`: did the bytes cross loopback TCP (remote) or not (local)?
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any, Final

KiB: Final = 1 << 10
MiB: Final = 1 << 20
GiB: Final = 1 << 30
DEFAULT_SIZES: Final = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
DEFAULT_OBJECTS: Final = 8
DEFAULT_REPEATS: Final = 5
DEFAULT_WORKING_SET_BYTES: Final = 1 * GiB
MODES: Final = ("remote", "local")
MAX_PROCS: Final = 8
MAX_OBJECTS: Final = 64
MAX_REPEATS: Final = 50
MAX_SIZE_BYTES: Final = 64 * MiB
MAX_WORKING_SET_BYTES: Final = 4 * GiB
DEFAULT_TIMEOUT_S: Final = 3600
# The ops of one repeat, in the order they run: zero-copy from/into registered buffers, then bytes copies.
OPS: Final = ("batch_put_from", "batch_get_into", "put_batch", "get_batch")
# Remote: loopback must carry at least this share of the payload (TCP/IP headers add ~3 %, RPCs a little);
# local: at most this share (the master's RPCs only).
REMOTE_MIN_LO_RATIO: Final = 0.9
LOCAL_MAX_LO_RATIO: Final = 0.05


def parse_sizes(text: str) -> list[int]:
    """`262144,1048576` → [262144, 1048576]; each a positive byte count ≤ MAX_SIZE_BYTES."""
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError("no sizes given")
    for size in sizes:
        if not 0 < size <= MAX_SIZE_BYTES:
            raise ValueError(f"size {size} B is outside 1..{MAX_SIZE_BYTES} B")
    return sizes


@dataclasses.dataclass(frozen=True)
class PeerArgs:
    sizes: list[int]
    objects: int
    repeats: int
    mode: str
    procs: int
    working_set_bytes: int
    json_path: str | None
    timeout_s: int  # the whole run, start to JSON


def _bounded_int(name: str, low: int, high: int) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{name} must be in {low}..{high}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/mooncake_peer.py",
        description="Mooncake Store's Python client measured as a user would use it (in .venv-mooncake)",
    )
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES), help="object sizes, bytes")
    p.add_argument("--objects", type=_bounded_int("--objects", 1, MAX_OBJECTS), default=DEFAULT_OBJECTS)
    p.add_argument("--repeats", type=_bounded_int("--repeats", 1, MAX_REPEATS), default=DEFAULT_REPEATS)
    p.add_argument("--mode", choices=MODES, default="remote")
    p.add_argument("--procs", type=_bounded_int("--procs", 1, MAX_PROCS), default=1)
    p.add_argument(
        "--working-set-bytes",
        type=_bounded_int("--working-set-bytes", 1, MAX_WORKING_SET_BYTES),
        default=DEFAULT_WORKING_SET_BYTES,
        help="bytes all processes put (then get) per pass, per size",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the result here")
    p.add_argument("--timeout-s", type=_bounded_int("--timeout-s", 1, 24 * 3600), default=DEFAULT_TIMEOUT_S)
    return p


def parse_args(argv: Sequence[str]) -> PeerArgs:
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    try:
        sizes = parse_sizes(ns.sizes)
    except ValueError as e:
        parser.error(f"--sizes: {e}")
    return PeerArgs(
        sizes=sizes,
        objects=ns.objects,
        repeats=ns.repeats,
        mode=ns.mode,
        procs=ns.procs,
        working_set_bytes=ns.working_set_bytes,
        json_path=ns.json_path,
        timeout_s=ns.timeout_s,
    )


def peer_argv(
    sizes: Sequence[int],
    objects: int,
    repeats: int,
    mode: str,
    procs: int,
    working_set_bytes: int,
    json_path: str,
    timeout_s: int,
) -> list[str]:
    """The peer's arguments (after the script path) that `parse_args` reads back as given."""
    return [
        "--sizes",
        ",".join(str(s) for s in sizes),
        "--objects",
        str(objects),
        "--repeats",
        str(repeats),
        "--mode",
        mode,
        "--procs",
        str(procs),
        "--working-set-bytes",
        str(working_set_bytes),
        "--json",
        json_path,
        "--timeout-s",
        str(timeout_s),
    ]


def plan(size: int, objects: int, procs: int, working_set_bytes: int) -> int:
    """Prompts (batch calls) per process per pass: at least one, else working_set / (procs × prompt)."""
    assert size > 0 and objects > 0 and procs > 0 and working_set_bytes > 0
    return max(1, working_set_bytes // (procs * objects * size))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (the same rule as bench/dataplane.py)."""
    assert sorted_values and 0.0 <= q <= 1.0
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def median(values: Sequence[float]) -> float:
    assert values
    return float(statistics.median(values))


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """One process's pass of one op in one repeat: `calls` batch calls, timed with perf_counter_ns
    (CLOCK_MONOTONIC, comparable between processes)."""

    start_ns: int
    end_ns: int
    payload_bytes: int
    call_ns: tuple[int, ...]
    errors: int  # keys a call reported failed (a negative code, or a short read)
    mismatches: int  # keys whose bytes differed from what was put (gets only)
    verified: int  # keys compared (gets only)


def run_gbps(records: Sequence[PassRecord]) -> float:
    """Aggregate GB/s (1e9 B/s) of one repeat: all processes' bytes / (last end - first start)."""
    assert records
    span_ns = max(r.end_ns for r in records) - min(r.start_ns for r in records)
    assert span_ns > 0
    return sum(r.payload_bytes for r in records) / span_ns


def summarize(runs: Sequence[Sequence[PassRecord]]) -> dict[str, Any]:
    """One point from its repeats (each a list of per-process records). GB/s is null when a call failed:
    bytes that did not move are not throughput."""
    assert runs and all(runs)
    gbps_runs = [run_gbps(records) for records in runs]
    call_ns = sorted(ns for records in runs for r in records for ns in r.call_ns)
    errors = sum(r.errors for records in runs for r in records)
    return {
        "gbps": round(median(gbps_runs), 3) if errors == 0 else None,
        "gbps_runs": [round(g, 3) for g in gbps_runs],
        "p50_ms": round(percentile(call_ns, 0.50) / 1e6, 3),
        "p99_ms": round(percentile(call_ns, 0.99) / 1e6, 3),
        "calls": len(call_ns),
        "bytes_per_run": sum(r.payload_bytes for r in runs[0]),
        "errors": errors,
        "mismatches": sum(r.mismatches for records in runs for r in records),
        "verified": sum(r.verified for records in runs for r in records),
    }


def tcp_verdict(mode: str, lo_bytes: int, payload_bytes: int) -> dict[str, Any]:
    """Remote: loopback grew by about the payload (≥ REMOTE_MIN_LO_RATIO of it); local: it stayed
    flat (≤ LOCAL_MAX_LO_RATIO)."""
    assert mode in MODES and payload_bytes > 0 and lo_bytes >= 0
    ratio = lo_bytes / payload_bytes
    ok = ratio >= REMOTE_MIN_LO_RATIO if mode == "remote" else ratio <= LOCAL_MAX_LO_RATIO
    return {"lo_bytes": lo_bytes, "payload_bytes": payload_bytes, "lo_ratio": round(ratio, 4), "ok": ok}


def size_label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB and size % MiB == 0 else f"{size / KiB:g} KiB"


def gbps_label(gbps: float | None) -> str:
    return "-" if gbps is None or math.isnan(gbps) else f"{gbps:.2f}"


def table(res: dict[str, Any]) -> str:
    """The peer's result (its JSON) as a markdown table: GB/s (p50 ms per batch call) per op and size."""
    sizes = res["sizes"]
    head = f"Mooncake Store ({res['version']}), {res['mode']}, {res['procs']} proc(s), GB/s (p50 ms)"
    lines = [head, "| op | " + " | ".join(size_label(s) for s in sizes) + " |"]
    lines.append("|---|" + "---:|" * len(sizes))
    for op in OPS:
        cells = []
        for s in sizes:
            p = next(p for p in res["points"] if p["size"] == s and p["op"] == op)
            cells.append(f"{gbps_label(p['gbps'])} ({p['p50_ms']:.2f})")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    tcp = res["tcp_check"]
    lines.append(
        f"tcp_check ok={tcp['ok']} lo/payload {tcp['min_lo_ratio']}..{tcp['max_lo_ratio']}; "
        f"errors={res['errors']} mismatches={res['mismatches']} of {res['verified']} verified; "
        f"{res['elapsed_s']} s"
    )
    if "repeats_started_busy" in res:
        busy, repeats = res["repeats_started_busy"], len(res["idle_share_at_start"])
        lines.append(f"{busy} of {repeats} repeats started on a busy machine (< 85 % idle)")
    return "\n".join(lines)

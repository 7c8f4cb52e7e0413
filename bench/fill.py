"""A writer faster than eviction fills the store: chunks refused and bytes stored, next to Mooncake Store.

    python -m bench.fill [--rounds 3] [--cases 16m-remote,4m-local,16m-remote-ssd] [--stem fill]

One engine saves prompts of 8 fresh chunks back to back, 20 untimed then `saves` timed, more bytes
than the 4 GiB segment holds (kvfabric: `python -m bench.client_save_profile` on its own local
cluster, one segment of `bench.client.SEGMENT_BYTES`; a save is `KvClient.save`), so the store must
evict while the writer runs. Arms, interleaved in every round:
- `kvfabric`: as built (the eviction policy's watermarks lowered by the measured inflow,
  `KVF_EVICTION_INFLOW_HORIZON_MS` at its default);
- `kvfabric, margin off`: `KVF_EVICTION_INFLOW_HORIZON_MS=0` (the configured watermarks only, as
  before 2026-12-05);
- `kvfabric, margin and demotion cut off` (the case with a disk tier under the segment only):
  `KVF_EVICTION_DEMOTE_CUT_FOR_ROOM=0` too, every victim demoted however long the disk takes;
- `Mooncake`: `bench/mooncake_fill.py` (`batch_put_from`, a 4 GiB segment, master's default eviction;
  remote = a separate store process over TCP, local = the writer's own segment), skipped with the
  reason when `.venv-mooncake` is missing (`make mooncake-setup`), and in the disk-tier case (the
  peer harness runs it without its disk offload).
Per arm: chunks refused (nothing stored for them; a kvfabric save reports them as `chunks_failed`,
a Mooncake key as a code other than 0), stored GB/s (bytes of the chunks stored / the timed
loop's seconds), p50 / p90 of one save. Markdown and JSON into bench/results/<stem>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

REPO: Final = Path(__file__).resolve().parents[1]
RESULTS: Final = REPO / "bench" / "results"
CASES: Final = {  # name: (chunk bytes, timed saves, co-located / Mooncake local, disk tier bytes)
    "16m-remote": (16 << 20, 100, False, 0),
    "4m-local": (4 << 20, 200, True, 0),
    "16m-remote-ssd": (16 << 20, 100, False, 8 << 30),
}
# kvfabric arms: the eviction policy's environment (the cluster's processes inherit it)
HORIZON: Final = "KVF_EVICTION_INFLOW_HORIZON_MS"
CUT: Final = "KVF_EVICTION_DEMOTE_CUT_FOR_ROOM"
KVFABRIC_ARMS: Final[dict[str, dict[str, str]]] = {
    "kvfabric": {},
    "kvfabric, margin off": {HORIZON: "0"},
    "kvfabric, margin and demotion cut off": {HORIZON: "0", CUT: "0"},  # disk-tier cases only
}
NO_DISK_PEER: Final = "the peer harness runs Mooncake Store without a disk tier"
OBJECTS: Final = 8
WARMUP: Final = 20  # what bench.client_save_profile saves before it times
RUN_TIMEOUT_S: Final = 600.0
STOP_TIMEOUT_S: Final = 120.0  # a run interrupted: its cluster's `down`


def arms(case: str) -> list[str]:
    with_disk = CASES[case][3] > 0
    kvf = [a for a in KVFABRIC_ARMS if with_disk or CUT not in KVFABRIC_ARMS[a]]
    return [*kvf, "Mooncake"]


def kvfabric(size: int, saves: int, colocated: bool, ssd_bytes: int, arm: str) -> dict[str, Any] | str:
    """One `bench.client_save_profile` run on a fresh local cluster: its JSON, or why there is none."""
    env = {k: v for k, v in os.environ.items() if k not in (HORIZON, CUT)}
    env.update(KVFABRIC_ARMS[arm])
    with tempfile.TemporaryDirectory(prefix="kvf-fill-") as tmp:
        out = Path(tmp) / "run.json"
        argv = [sys.executable, "-m", "bench.client_save_profile", "--size", str(size), "--saves", str(saves)]
        argv += ["--objects", str(OBJECTS), "--json", str(out), "--ssd-bytes", str(ssd_bytes)]
        argv += ["--shm"] if colocated else []
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            said, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # its `local_cluster` block takes the cluster down
            try:
                proc.communicate(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            return f"bench.client_save_profile ran past {RUN_TIMEOUT_S:.0f} s"
        if not out.exists():  # it exits 1 when chunks failed, with its figures written
            return f"bench.client_save_profile exited {proc.returncode}: {said[-1500:]}"
        figures: dict[str, Any] = json.loads(out.read_text())
        return figures


def mooncake(size: int, saves: int, colocated: bool) -> dict[str, Any] | str:
    from bench.client import SEGMENT_BYTES
    from bench.mooncake import measure_fill

    args = ["--mode", "local" if colocated else "remote", "--size", str(size), "--saves", str(saves)]
    args += ["--objects", str(OBJECTS), "--warmup", str(WARMUP), "--segment-bytes", str(SEGMENT_BYTES)]
    return measure_fill(args, RUN_TIMEOUT_S)


def table(results: dict[str, dict[str, list[dict[str, Any] | str]]], rounds: int) -> str:
    lines = [
        "| case | arm | chunks refused per round | stored GB/s (median; per round) | save p50 / p90 ms |",
        "|---|---|---|---|---|",
    ]
    for case, arms in results.items():
        saves = CASES[case][1]
        for arm, runs in arms.items():
            ok = [r for r in runs if isinstance(r, dict)]
            if not ok:
                why = next((r for r in runs if isinstance(r, str)), "not run")
                lines.append(f"| {case} | {arm} | not measured: {why[:200]} | | |")
                continue
            refused = " / ".join(f"{r['chunks_failed']} of {saves * OBJECTS}" for r in ok)
            if any(r.get("verified") is False for r in ok):  # Mooncake's read-back check
                refused += " (a read-back did not match)"
            gbs = [r["stored_gb_per_s"] for r in ok]
            per = ", ".join(f"{g:.2f}" for g in gbs)
            p50 = statistics.median(r["p50_ms"] for r in ok)
            p90 = statistics.median(r["p90_ms"] for r in ok)
            stored = f"{statistics.median(gbs):.2f} ({per})"
            lines.append(f"| {case} | {arm} | {refused} | {stored} | {p50:.1f} / {p90:.1f} |")
    tail = f"{rounds} round(s), arms interleaved; {OBJECTS} chunks a save; p50 / p90: medians over rounds."
    return "\n".join(lines) + f"\n\n{tail}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fill", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--stem", default="fill", help="bench/results/<stem>.md and .json")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if args.rounds < 1 or not cases or unknown:
        parser.error(f"--rounds must be at least 1 and --cases a subset of {', '.join(CASES)}")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load = os.getloadavg()[0]
    results: dict[str, dict[str, list[dict[str, Any] | str]]] = {c: {a: [] for a in arms(c)} for c in cases}
    for rnd in range(args.rounds):
        for case in cases:
            size, saves, colocated, ssd_bytes = CASES[case]
            for arm in arms(case):
                run: dict[str, Any] | str
                if arm != "Mooncake":
                    run = kvfabric(size, saves, colocated, ssd_bytes, arm)
                elif ssd_bytes:
                    run = NO_DISK_PEER
                else:
                    run = mooncake(size, saves, colocated)
                results[case][arm].append(run)
                write(args, started, load, results)  # what is measured so far survives a stop
                said = (
                    run
                    if isinstance(run, str)
                    else f"{run['chunks_failed']} refused, {run['stored_gb_per_s']:.2f} GB/s"
                )
                print(f"round {rnd + 1} {case} {arm}: {said}", flush=True)
    print(write(args, started, load, results), flush=True)
    return 0


def write(
    args: argparse.Namespace,
    started: str,
    load: float,
    results: dict[str, dict[str, list[dict[str, Any] | str]]],
) -> str:
    """bench/results/<stem>.md and .json as they stand; the table."""
    text = table(results, args.rounds)
    header = f"# `python -m bench.fill --rounds {args.rounds} --cases {','.join(results)}`\n\n"
    header += f"Started {started}, load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} now.\n\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.stem}.md").write_text(header + text)
    (RESULTS / f"{args.stem}.json").write_text(
        json.dumps({"started": started, "rounds": args.rounds, "results": results}, indent=1) + "\n"
    )
    return text


if __name__ == "__main__":
    sys.exit(main())

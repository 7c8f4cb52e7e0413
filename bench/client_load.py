"""The client's load path, two versions side by side (issue 20): `lookup` + `load` + `release` and
`load` alone through the client code at `--base` (a git revision) and through this checkout's,
against one cluster, in one run, rounds interleaved, with the transport get of the same objects
in the same rounds.

`python -m bench.client` measures one client version per run; on this shared 2-core VM the other
jobs move its figures by ±40 % between runs, more than a change of the load path does. Here both
versions read the same working set from the same segment in the same minutes, each round A then B
or B then A (alternating), and the transport get (`TcpDataClient.get_hashed` /
`ShmReader.get_hashed`: a hit's objects in one request, no client) runs in every round too, so
each version's figure is also given ÷ the transport in the same run.

- Cluster: `bench.client.local_cluster` (tools/localcluster.py: authenticated NATS, one directory,
  one 4 GiB segment, eviction policy, repair, prefetch), the services of this checkout.
- Engines: two spawned processes (`bench/client_save_worker.py`: bench.client's engine with its
  client code from a folder of its own), A with `kvfabric.client` from `git archive <base>`, B with
  this checkout's; everything below the client (format, proto, data plane) is this checkout's.
  Both use one model id, so they read the same objects: A saves the working set (≥ 512 MiB per
  size, rotating reads, bench.client's rule) and both are told its checksums.
- Per size, op and client (remote: TCP; co-located: the segment's shared memory), each round runs
  N = max(1, 64 MiB / (8 × size)) prompts in each version; the transport rows after them, in B.
- Every loaded byte is compared with its expected checksum after the run (bench.client's rule);
  a mismatch or a short load fails the point (exit 1).

Run: `.venv/bin/python -m bench.client_load --base <rev>` from the repository root. Writes
bench/results/client_load_ab.{json,md} (`--stem`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Final

from bench.client import (
    CLIENT_LABEL,
    MEASURE_BYTES,
    PREPARE_TIMEOUT_S,
    REPO,
    RESULTS,
    WORKING_SET_BYTES,
    Point,
    loadavg,
    local_cluster,
    prompts_per_run,
    read_env_file,
    working_prompts,
)
from bench.client_save import Engine, client_at
from bench.client_worker import CHUNKS, Task
from bench.dataplane import _recv, fmt, machine, ratio, size_label, wait_idle

SIZES: Final = (256 << 10, 1 << 20)
OPS: Final = ("lookup_load_release", "load")
TRANSPORT: Final = {"remote": "tcp_get", "local": "shm_get"}
IDLE_WAIT_MAX_S: Final = 5.0


def call(engine: Engine, msg: tuple[Any, ...], timeout_s: float) -> tuple[Any, ...]:
    engine.pipe.send(msg)
    reply: tuple[Any, ...] = _recv(engine.pipe, timeout_s, msg[0])
    if reply[0] == "error":
        raise RuntimeError(f"{msg[0]}: {reply[1]}")
    return reply


def cpu_ticks(pids: list[int]) -> int:
    """utime + stime of these processes, in clock ticks (a process gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total


def paired(a_runs: list[float], b_runs: list[float]) -> float | None:
    """The median of B ÷ A over the rounds both measured (each pair ran back to back)."""
    ratios = [b / a for a, b in zip(a_runs, b_runs, strict=False) if a > 0]
    return statistics.median(ratios) if ratios else None


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    a, b = result["base"], result["head"]
    lines = [
        f"### Client load path, {a} (A) vs {b} (B) ({result['date']}; {m['cpu']}, {m['cores']} cores, "
        f"Python {m['python']})",
        "",
        f"`{result['command']}`, {result['elapsed_s']:.0f} s; load average at start / end "
        f"{result['loadavg_start']} / {result['loadavg_end']} (a shared machine). One cluster, both client "
        f"versions in separate engine processes reading the same objects, rounds interleaved (A then B, "
        f"then B then A, ...), the transport get of the same hits in every round; GB/s = 1e9 B/s, median "
        f"of {result['repeats']} rounds (and the median of B ÷ A within each round); a prompt = "
        f"{CHUNKS} objects of the size; p50 per prompt call in ms. {result['verified_objects']} "
        f"objects compared, {result['mismatches']} mismatches, "
        f"{result['short']} chunks short. CPU ms/prompt: every cluster process and the engine, per run "
        "(its untimed lookups, releases and verification included), summed over the rounds.",
        "",
        "| client | op | size | GB/s A | GB/s B | B ÷ A | B ÷ A per round | p50 ms A | p50 ms B "
        "| transport GB/s | A ÷ transport | B ÷ transport | CPU ms/prompt A / B |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    pts = result["points"]
    cpu = result.get("cpu_ms_per_prompt", {})
    for client in CLIENT_LABEL:
        for op in result["ops"]:
            for size in result["sizes"]:
                pa, pb = (pts[f"{side}:{client}:{op}:{size}"] for side in ("A", "B"))
                pt = pts[f"T:{client}:{TRANSPORT[client]}:{size}"]
                lines.append(
                    f"| {CLIENT_LABEL[client]} | {op} | {size_label(size)} | {fmt(pa['gbps'])} "
                    f"| {fmt(pb['gbps'])} | {fmt(ratio(pb['gbps'], pa['gbps']))} "
                    f"| {fmt(paired(pa['gbps_runs'], pb['gbps_runs']))} "
                    f"| {fmt(pa['p50_ms'], '.2f')} | {fmt(pb['p50_ms'], '.2f')} | {fmt(pt['gbps'])} "
                    f"| {fmt(ratio(pa['gbps'], pt['gbps']))} | {fmt(ratio(pb['gbps'], pt['gbps']))} "
                    f"| {fmt(cpu.get(f'A:{client}:{op}:{size}'), '.1f')} / "
                    f"{fmt(cpu.get(f'B:{client}:{op}:{size}'), '.1f')} |"
                )
    if result["problems"]:
        lines += ["", "Not verified:", ""] + [f"- {p}" for p in result["problems"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base", required=True, help="git revision of the A client")
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--working-set-mib", type=int, default=WORKING_SET_BYTES >> 20)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--stem", default="client_load_ab")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ops = [o for o in args.ops.split(",") if o]
    if set(ops) - set(OPS) or not ops:
        parser.error(f"--ops: choose from {', '.join(OPS)}")
    head = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    base = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    command = "python -m bench.client_load " + " ".join(sys.argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (cluster down) on SIGTERM too
    started = time.monotonic()
    load_start = loadavg()
    ctx = mp.get_context("spawn")
    points: dict[str, Point] = {}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvf-bench-client-load-")))
        code = {"A": str(client_at(args.base, tmp / "a")), "B": ""}
        state = stack.enter_context(local_cluster(tmp / "cluster"))
        env = read_env_file(Path(state["auth"]["dir"]) / "env" / "tenant-demo.env")
        ring = max(prompts_per_run(s, MEASURE_BYTES) * CHUNKS * s for s in sizes)
        model_id = f"bench-client-load-{secrets.token_hex(4)}"  # one for both: the same objects
        engines: dict[str, Engine] = {}
        for i, side in enumerate(("A", "B")):
            config = {
                "env": env,
                "nats_url": state["nats_url"],
                "model_id": model_id,
                "redis_port": None,
                "ring_bytes": ring,
                "index": i,
            }
            engines[side] = Engine(ctx, code[side], config, f"engine-{side}")
            stack.callback(engines[side].close)
        print(f"cluster up ({state['nats_url']}); A = {base} client, B = {head}", flush=True)
        run_ids = iter(range(1, 1 << 40))
        # CPU of every cluster process and the engine per run (the run's untimed parts too: its
        # lookups or releases outside the timer, the verification): less moved by other jobs than
        # wall time on a loaded machine.
        cluster_pids = [pid for pid in state.get("pids", {}).values() if pid]
        hz = os.sysconf("SC_CLK_TCK")
        cpu_s: dict[str, float] = {}
        prompts: dict[str, int] = {}
        for size in sizes:
            n = prompts_per_run(size, MEASURE_BYTES)
            count = working_prompts(size, args.working_set_mib << 20, 1, MEASURE_BYTES)
            reply = call(engines["A"], ("working", size, count), PREPARE_TIMEOUT_S)
            if reply[2]:
                raise RuntimeError(f"could not save the {size_label(size)} working set: {reply[2]}")
            for engine in engines.values():
                call(engine, ("set_working", size, reply[1]), PREPARE_TIMEOUT_S)
            print(f"  {size_label(size)}: working set of {count} prompts saved", flush=True)
            cursor = 0
            for r in range(args.repeats):
                wait_idle(max_wait_s=IDLE_WAIT_MAX_S)
                order = ("A", "B") if r % 2 == 0 else ("B", "A")
                for client in CLIENT_LABEL:
                    runs: list[tuple[str, str]] = [(side, op) for op in ops for side in order]
                    runs.append(("T", TRANSPORT[client]))
                    for side, op in runs:
                        key = f"{side}:{client}:{op}:{size}"
                        label = "transport" if side == "T" else side
                        point = points.setdefault(
                            key, Point(f"{label} {CLIENT_LABEL[client]}", op, key, size, 1, n)
                        )
                        if point.error:
                            continue
                        engine = engines["B" if side == "T" else side]
                        task = Task(
                            op, "" if side == "T" else client, size, n, cursor % count, next(run_ids), 1
                        )
                        cursor += n
                        before = cpu_ticks([*cluster_pids, engine.proc.pid])
                        point.add([engine.run(task)])
                        spent = (cpu_ticks([*cluster_pids, engine.proc.pid]) - before) / hz
                        cpu_s[key] = cpu_s.get(key, 0.0) + spent
                        prompts[key] = prompts.get(key, 0) + n
            call(engines["A"], ("evict_working", size, count), PREPARE_TIMEOUT_S)
            for key, p in points.items():
                if key.endswith(f":{size}"):
                    print(f"  {size_label(size)} {key}: {[round(x, 3) for x in p.runs]}", flush=True)
    records = {k: p.record() for k, p in points.items()}
    problems = [f"{k}: {r['error']}" for k, r in records.items() if r["error"]]
    result: dict[str, Any] = {
        "bench": "client_load",
        "date": time.strftime("%Y-%m-%d"),
        "command": command,
        "machine": machine(),
        "base": base,
        "head": head,
        "sizes": sizes,
        "ops": ops,
        "repeats": args.repeats,
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "verified_objects": sum(r["verified"] for r in records.values()),
        "mismatches": sum(r["mismatches"] for r in records.values()),
        "short": sum(r["short"] for r in records.values()),
        "problems": problems,
        "points": records,
        "cpu_ms_per_prompt": {k: round(cpu_s[k] / prompts[k] * 1e3, 3) for k in cpu_s if prompts.get(k)},
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out / f"{args.stem}.md").write_text(md)
    print(md)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""The client's save path, two versions side by side (issue 20): `KvClient.save` and `save_async`
of the client code at `--base` (a git revision) and of this checkout, against one cluster, in one
run, interleaved.

`python -m bench.client` measures one client version per run: on this shared 2-core VM the load of
the other jobs moves its figures by ±30 % from one run to the next, more than a change of the save
path does. Here both versions run against the same cluster in the same minutes, each round A then
B or B then A (alternating), so a slow spell hits both alike; what is reported is each version's
median GB/s and p50 per prompt, and B ÷ A.

- Cluster: `bench.client.local_cluster` (tools/localcluster.py: authenticated NATS, one directory,
  one 4 GiB segment, eviction policy, repair, prefetch), the services of this checkout.
- Engines: two spawned processes (`bench/client_save_worker.py`), the same engine as bench.client's
  (`bench.client_worker`), one with `kvfabric.client` from `git archive <base>`, one with this
  checkout's; everything else (format, proto, data plane) is this checkout's.
- Per size, op (`save`: sync, prompts back to back; `save_async`: all pipelined, then every future)
  and client (remote: TCP; co-located: the segment's shared memory for what it reads), each round
  runs N = max(1, 64 MiB / (8 × size)) fresh prompts in each version. Every SaveResult must publish
  every chunk; the first and last prompt of each run are loaded back and their bytes compared
  (bench.client's rule); the run's prompts are evicted afterwards.

Run: `.venv/bin/python -m bench.client_save --base <rev>` from the repository root. Writes
bench/results/client_save_ab.{json,md} (`--stem`); exits 1 when a byte did not verify.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import ExitStack, suppress
from io import BytesIO
from pathlib import Path
from typing import Any, Final

from bench.client import (
    CLIENT_LABEL,
    MEASURE_BYTES,
    REPO,
    RESULTS,
    RUN_TIMEOUT_S,
    WORKER_START_TIMEOUT_S,
    Point,
    loadavg,
    local_cluster,
    prompts_per_run,
    read_env_file,
)
from bench.client_save_worker import main as engine_main
from bench.client_worker import CHUNKS, Outcome, Task
from bench.dataplane import _recv, _stop, fmt, machine, ratio, size_label, wait_idle

SIZES: Final = (256 << 10, 1 << 20, 4 << 20)
OPS: Final = ("save", "save_async")
IDLE_WAIT_MAX_S: Final = 5.0
CLIENT_PATH: Final = "libs/client/src"


def client_at(rev: str, into: Path) -> Path:
    """The folder holding `kvfabric/client/` as of `rev` (`git archive`)."""
    blob = subprocess.run(
        ["git", "archive", rev, f"{CLIENT_PATH}/kvfabric/client"], cwd=REPO, capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into / CLIENT_PATH


class Engine:
    """One engine process with its own client code."""

    def __init__(self, ctx: Any, code_path: str, config: dict[str, Any], name: str) -> None:
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, code_path, config), name=name)
        self.proc.start()
        child.close()
        reply = _recv(self.pipe, WORKER_START_TIMEOUT_S, f"{name} start")
        if reply[0] != "ready":
            raise RuntimeError(f"{name} did not start: {reply[1]}")

    def run(self, task: Task) -> Outcome:
        self.pipe.send(("run", task))
        reply = _recv(self.pipe, RUN_TIMEOUT_S, f"run {task.op}")
        return reply if isinstance(reply, Outcome) else Outcome(error=str(reply[1])[-800:])

    def close(self) -> None:
        with suppress(OSError):
            self.pipe.send(None)
        _stop(self.proc, 30)


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    a, b = result["base"], result["head"]
    lines = [
        f"### Client save path, {a} (A) vs {b} (B) ({result['date']}; {m['cpu']}, {m['cores']} cores, "
        f"Python {m['python']})",
        "",
        f"`{result['command']}`, {result['elapsed_s']:.0f} s; load average at start / end "
        f"{result['loadavg_start']} / {result['loadavg_end']} (a shared machine). One cluster, both client "
        f"versions in separate engine processes, rounds interleaved (A then B, then B then A, ...); GB/s = "
        f"1e9 B/s, median of {result['repeats']} rounds; a prompt = {CHUNKS} objects of the size; p50 per "
        f"prompt call in ms. {result['verified_objects']} objects read back and compared, "
        f"{result['mismatches']} mismatches, {result['short']} chunks short.",
        "",
        "| client | op | size | GB/s A | GB/s B | B ÷ A | p50 ms A | p50 ms B | runs A / B (GB/s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for client in CLIENT_LABEL:
        for op in result["ops"]:
            for size in result["sizes"]:
                pa, pb = (result["points"][f"{side}:{client}:{op}:{size}"] for side in ("A", "B"))
                label = f"| {CLIENT_LABEL[client]} | {op} | {size_label(size)} "
                lines.append(
                    f"{label}| {fmt(pa['gbps'])} | {fmt(pb['gbps'])} "
                    f"| {fmt(ratio(pb['gbps'], pa['gbps']))} | {fmt(pa['p50_ms'], '.2f')} "
                    f"| {fmt(pb['p50_ms'], '.2f')} | {pa['gbps_runs']} / {pb['gbps_runs']} |"
                )
    if result["problems"]:
        lines += ["", "Not verified:", ""] + [f"- {p}" for p in result["problems"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--base", required=True, help="git revision of the A client")
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--stem", default="client_save_ab")
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
    command = "python -m bench.client_save " + " ".join(sys.argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (cluster down) on SIGTERM too
    started = time.monotonic()
    load_start = loadavg()
    ctx = mp.get_context("spawn")
    points: dict[str, Point] = {}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvf-bench-client-save-")))
        code = {"A": str(client_at(args.base, tmp / "a")), "B": ""}
        state = stack.enter_context(local_cluster(tmp / "cluster"))
        env = read_env_file(Path(state["auth"]["dir"]) / "env" / "tenant-demo.env")
        ring = max(prompts_per_run(s, MEASURE_BYTES) * CHUNKS * s for s in sizes)
        engines: dict[str, Engine] = {}
        for i, side in enumerate(("A", "B")):
            config = {
                "env": env,
                "nats_url": state["nats_url"],
                "model_id": f"bench-client-save-{secrets.token_hex(4)}",
                "redis_port": None,
                "ring_bytes": ring,
                "index": i,
            }
            engines[side] = Engine(ctx, code[side], config, f"engine-{side}")
            stack.callback(engines[side].close)
        print(f"cluster up ({state['nats_url']}); A = {base} client, B = {head}", flush=True)
        run_ids = iter(range(1, 1 << 40))
        for size in sizes:
            n = prompts_per_run(size, MEASURE_BYTES)
            for r in range(args.repeats):
                wait_idle(max_wait_s=IDLE_WAIT_MAX_S)
                order = ("A", "B") if r % 2 == 0 else ("B", "A")
                for op in ops:
                    for client in CLIENT_LABEL:
                        for side in order:
                            key = f"{side}:{client}:{op}:{size}"
                            point = points.setdefault(
                                key, Point(f"{side} {CLIENT_LABEL[client]}", op, key, size, 1, n)
                            )
                            if point.error:
                                continue
                            task = Task(op, client, size, n, 0, next(run_ids), 1)
                            point.add([engines[side].run(task)])
            for side in ("A", "B"):
                for op in ops:
                    for client in CLIENT_LABEL:
                        p = points[f"{side}:{client}:{op}:{size}"]
                        print(
                            f"  {size_label(size)} {side} {CLIENT_LABEL[client]} {op}: {p.runs}", flush=True
                        )
    records = {k: p.record() for k, p in points.items()}
    problems = [f"{k}: {r['error']}" for k, r in records.items() if r["error"]]
    result: dict[str, Any] = {
        "bench": "client_save",
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

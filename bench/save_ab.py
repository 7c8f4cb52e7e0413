"""The save path's CPU per process, one git revision (A) against this checkout (B), interleaved.

Each round runs `bench.client_save_profile` once per variant, in alternating order (A B, then
B A, ...), each with a local cluster of its own whose services (directory, segment, eviction
policy, repair, prefetch) and libraries import A's or B's code: A from a `git worktree` of
`--base` made in a temporary folder (removed at the end), B from this checkout. The bench
itself, the cluster tool and the client are this checkout's in both (`--client-too` runs A's
client as well). Reports, per size, the median over rounds of the save's p50 and of each
process's CPU per save, and B ÷ A.

Run: `.venv/bin/python -m bench.save_ab --base HEAD~1 [--sizes 262144,1048576] [--saves 200]
[--rounds 3] [--shm] [--save-memory] [--json bench/results/x.json]` (`--shm`: a co-located
client; `--save-memory`: it saves from its save memory, `KvClient.save_memory`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def source_dirs(root: Path) -> list[str]:
    """The `src` folders of every package in `root` (what the venv's editable installs name)."""
    return sorted(
        str(p) for p in [*root.glob("libs/*/src"), *root.glob("services/*/src"), root / "proto_schemas/src"]
    )


def run_once(
    root: Path,
    size: int,
    saves: int,
    objects: int,
    out: Path,
    client_too: bool,
    shm: bool = False,
    save_memory: bool = False,
) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(source_dirs(root)))
    if not client_too:  # the client stays this checkout's
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "libs/client/src"), env["PYTHONPATH"]])
    cmd = [sys.executable, "-m", "bench.client_save_profile", "--size", str(size), "--saves", str(saves)]
    cmd += ["--objects", str(objects), "--json", str(out), *(["--shm"] if shm else [])]
    cmd += ["--save-memory"] if save_memory else []
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    # A run with failed chunks (exit 1) still wrote its figures: reported, left out of the medians
    if proc.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"client_save_profile failed ({root}): {(proc.stdout + proc.stderr)[-3000:]}")
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision of variant A")
    parser.add_argument("--sizes", default="262144,1048576")
    parser.add_argument("--saves", type=int, default=200)
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client-too", action="store_true", help="A runs its own client as well")
    parser.add_argument("--shm", action="store_true", help="a co-located client (staged writes)")
    parser.add_argument("--save-memory", action="store_true", help="save from the client's save memory")
    parser.add_argument("--json", default="", help="write every run's figures here")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    started = time.time()
    load_start = os.getloadavg()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvf-save-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=REPO, check=True)
        try:
            for r in range(args.rounds):
                for size in sizes:
                    order = ("A", "B") if r % 2 == 0 else ("B", "A")
                    for variant in order:
                        root = base if variant == "A" else REPO
                        out = Path(tmp) / f"{variant}-{size}-{r}.json"
                        figures = run_once(
                            root,
                            size,
                            args.saves,
                            args.objects,
                            out,
                            args.client_too,
                            args.shm,
                            args.save_memory,
                        )
                        figures.update(variant=variant, round=r)
                        runs.append(figures)
                        cpu = figures["cpu_ms_per_save"]
                        failed = figures.get("chunks_failed", 0)
                        print(
                            f"round {r} {variant} {size >> 10} KiB: p50 {figures['p50_ms']:.2f} ms, "
                            f"client {cpu.get('client', 0):.2f}, segment {cpu.get('segment-1', 0):.2f}, "
                            f"directory {cpu.get('directory', 0):.2f}, nats {cpu.get('nats', 0):.2f}, "
                            f"eviction {cpu.get('eviction', 0):.2f}, all {sum(cpu.values()):.2f} ms CPU/save"
                            + (f"; {failed} chunks failed: not counted" if failed else ""),
                            flush=True,
                        )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=False)
    load_end = os.getloadavg()
    print(
        f"\n{len(runs)} runs, {time.time() - started:.0f} s, load average "
        f"{' '.join(f'{x:.2f}' for x in load_start)} -> {' '.join(f'{x:.2f}' for x in load_end)}"
    )
    names = [*sorted({n for run in runs for n in run["cpu_ms_per_save"]}), "all"]
    print("| size | figure | A | B | B ÷ A |\n|---:|---|---:|---:|---:|")
    for size in sizes:

        def median(variant: str, figure: str, size: int = size) -> float:
            values: list[float] = []
            for run in runs:
                if run["variant"] != variant or run["size"] != size or run.get("chunks_failed", 0):
                    continue
                cpu = run["cpu_ms_per_save"]
                values.append(
                    run["p50_ms"]
                    if figure == "p50"
                    else sum(cpu.values())
                    if figure == "all"
                    else cpu.get(figure, 0.0)
                )
            return statistics.median(values) if values else float("nan")

        for figure in ["p50", *names]:
            a, b = median("A", figure), median("B", figure)
            label = "save p50, ms" if figure == "p50" else f"{figure} CPU per save, ms"
            print(f"| {size >> 10} KiB | {label} | {a:.2f} | {b:.2f} | {b / a if a else float('nan'):.2f} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"base": args.base, "load": [load_start, load_end], "runs": runs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

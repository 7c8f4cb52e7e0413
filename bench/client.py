"""Client-level benchmark (issue 20): the public client API exactly as an engine calls it, next to
Mooncake Store's Python client, Redis and the transport ceiling, measured in one run.

Per object size (256 KiB … 16 MiB; a prompt = 8 chunks of 16 tokens × one object): GB/s and p50/p99
per prompt call, with 1 engine process and 4 concurrent engine processes (aggregate GB/s = all bytes
/ (last end - first start), latencies pooled). GB = 1e9 B.

- Cluster: `tools/localcluster.py up` in a temporary run folder (authenticated NATS on a free port,
  one directory, one 4 GiB segment, the eviction-policy, repair and prefetch services), `down` at the
  end, also on an error or Ctrl-C. The engines are the `demo` tenant (its `KVF_CLIENT_*` env file).
- Engines: spawned processes (`bench/client_worker.py`), each with two `KvClient`s: remote
  (`use_shm=False`, every byte over TCP) and co-located (`use_shm=True`, reads from the segment's
  shared-memory arena). 1 engine = worker 0; 4 engines = 4 workers that prepare, meet at a barrier
  and run at once.
- Ops (per engine and run: N = max(1, 64 MiB / (8 × size)) prompts back to back): `save` (sync,
  fresh prompts), `save_async` (all N pipelined, then every future), `save_memory` (co-located:
  `save` from the client's save memory, `KvClient.save_memory`, which the engine gathers into as
  Mooncake's `batch_put_from` reads a registered buffer), `lookup+load+release`, `load`
  (lookups and releases outside the timer). Loads read a working set of ≥ 512 MiB per size saved
  beforehand, rotating over it (objects not in the 32 MiB L3). Saves are evicted after each run
  (a tenant may evict its own groups), so the arena never fills; the working set after its size.
- Same run, same segment, same objects: `transport get` tcp / shm (`TcpDataClient.get_hashed` /
  `ShmReader.get_hashed`: the hit's 8 objects in one request, after an untimed lookup), cold memcpy
  (numpy copyto) as the machine's limit, Redis SET/GET through redis-py (own redis-server, one key
  an object), and Mooncake Store (`bench/mooncake.py`: master + a store process, remote and local,
  `batch_put_from` / `batch_get_into` and `put_batch` / `get_batch`), run after the cluster is down.
- Bytes verified: every object has an expected xxh3-128 checksum; after every run (untimed) each
  destination is compared with it; a mismatch or a chunk not loaded (short) is reported with its
  cause, the point gets no GB/s, and the benchmark exits 1. Saves must publish every chunk, and the
  first and last prompt of each save run are loaded back and compared.
- Each point runs `--repeats` times (median GB/s), the runs of all points of a size interleaved, each
  round once the machine is idle (other jobs share it).

Run: `.venv/bin/python -m bench.client` from the repository root (or `make bench`). Writes
bench/results/client.json and client.md; exits 1 when any kvfabric, transport or Redis byte did not
verify. `--quick`: one repeat, 16 MiB measurements, a 128 MiB working set, at most 2 s waiting for
an idle machine, Mooncake's 1-process runs only (a smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any, Final

from bench.client_worker import CHUNKS, CLIENT_OPS, Outcome, Task, WorkerConfig, worker_main
from bench.dataplane import (
    PointTimeout,
    _recv,
    _stop,
    fmt,
    machine,
    process_cpu,
    ratio,
    redis_process,
    size_label,
    versions,
    wait_idle,
)

REPO: Final = Path(__file__).resolve().parents[1]
RESULTS: Final = REPO / "bench" / "results"
KiB: Final = 1 << 10
MiB: Final = 1 << 20
GiB: Final = 1 << 30
SIZES: Final = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
ENGINES: Final = (1, 4)
SEGMENT_BYTES: Final = 4 * GiB
SEGMENT_CONNECTIONS_MAX: Final = 256  # 4 engines × 2 clients × 8 connections + readers (default 64)
MEASURE_BYTES: Final = 64 * MiB  # per engine and run (at least one prompt)
WORKING_SET_BYTES: Final = 512 * MiB  # per size, read by the loads (16 × the L3)
QUICK_MEASURE_BYTES: Final = 16 * MiB
QUICK_WORKING_SET_BYTES: Final = 128 * MiB
ARENA_USE_MAX: Final = 0.5  # working set + one run's saves stay under this share of the arena
CLUSTER_TIMEOUT_S: Final = 180.0
WORKER_START_TIMEOUT_S: Final = 180.0
RUN_TIMEOUT_S: Final = 300.0
PREPARE_TIMEOUT_S: Final = 900.0
MOONCAKE_TIMEOUT_S: Final = 1800.0
QUICK_MOONCAKE_TIMEOUT_S: Final = 600.0
IDLE_WAIT_MAX_S: Final = 15.0
QUICK_IDLE_WAIT_MAX_S: Final = 2.0

# (row, op label, op, client): client = "remote" | "local" | "" (below the client API)
ROWS: Final = (
    ("kvfabric remote", "save", "save", "remote"),
    ("kvfabric remote", "save_async, pipelined", "save_async", "remote"),
    ("kvfabric remote", "lookup+load+release", "lookup_load_release", "remote"),
    ("kvfabric remote", "load", "load", "remote"),
    ("kvfabric co-located", "save", "save", "local"),
    ("kvfabric co-located", "save_async, pipelined", "save_async", "local"),
    ("kvfabric co-located", "save from save memory", "save_memory", "local"),
    ("kvfabric co-located", "lookup+load+release", "lookup_load_release", "local"),
    ("kvfabric co-located", "load", "load", "local"),
    ("transport get", "tcp, 8 objects/request", "tcp_get", ""),
    ("transport get", "shm, 8 objects/request", "shm_get", ""),
    ("memcpy", "copy, cold source", "memcpy", ""),
    ("redis", "SET", "redis_set", ""),
    ("redis", "GET", "redis_get", ""),
)
MOONCAKE_MODES: Final = ("remote", "local")
MOONCAKE_OPS: Final = ("batch_put_from", "batch_get_into", "put_batch", "get_batch")
MOONCAKE_ROWS: Final = tuple(
    (f"mooncake {mode}", op, op, mode) for mode in MOONCAKE_MODES for op in MOONCAKE_OPS
)
CLIENT_LABEL: Final = {"remote": "remote", "local": "co-located"}
OPS: Final = tuple(dict.fromkeys(op for _, _, op, _ in ROWS))  # `--ops` names these
# Rows that read the working set (saved before the runs of a size); the others need none.
READ_OPS: Final = frozenset(("lookup_load_release", "load", "tcp_get", "shm_get", "memcpy", "redis_get"))


def kind(op: str, client: str) -> str:
    """A point's kind: `remote:load`, `local:save`, `tcp_get`, `mooncake_local:batch_get_into`."""
    return f"{client}:{op}" if client else op


def mooncake_kind(mode: str, op: str) -> str:
    return f"mooncake_{mode}:{op}"


# What each kvfabric row is compared with (same client count): Mooncake's op in the same mode, the
# transport get under the same client, Redis.
MOONCAKE_REF: Final = {
    **{
        kind(op, c): mooncake_kind(c, "batch_put_from") for op in ("save", "save_async") for c in CLIENT_LABEL
    },
    kind("save_memory", "local"): mooncake_kind("local", "batch_put_from"),
    **{
        kind(op, c): mooncake_kind(c, "batch_get_into")
        for op in ("lookup_load_release", "load")
        for c in CLIENT_LABEL
    },
}
TRANSPORT_REF: Final = {
    kind(op, c): ("tcp_get" if c == "remote" else "shm_get")
    for op in ("lookup_load_release", "load")
    for c in CLIENT_LABEL
}
REDIS_REF: Final = {
    **{kind(op, c): "redis_set" for op in ("save", "save_async") for c in CLIENT_LABEL},
    kind("save_memory", "local"): "redis_set",
    **{kind(op, c): "redis_get" for op in ("lookup_load_release", "load") for c in CLIENT_LABEL},
    "tcp_get": "redis_get",
    "shm_get": "redis_get",
}


# ---- pure: statistics, points, verdicts ----------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (the rule of bench/dataplane.py)."""
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


def aggregate_gbps(spans: Sequence[tuple[float, float, int]]) -> float:
    """GB/s (1e9 B/s) of one run of concurrent engines, each (t0, t1, bytes): all bytes / (last
    end - first start)."""
    elapsed = max(t1 for _, t1, _ in spans) - min(t0 for t0, _, _ in spans)
    if elapsed <= 0:
        raise ValueError("a run took no time")
    return sum(b for _, _, b in spans) / elapsed / 1e9


def prompts_per_run(size: int, measure_bytes: int) -> int:
    """Prompts per engine and run: about `measure_bytes`, at least one."""
    return max(1, measure_bytes // (CHUNKS * size))


def working_prompts(size: int, working_set_bytes: int, engines_max: int, measure_bytes: int) -> int:
    """Prompts of a size's working set: ≥ `working_set_bytes`, and enough that the engines of one
    run read distinct prompts."""
    return max(
        math.ceil(working_set_bytes / (CHUNKS * size)), engines_max * prompts_per_run(size, measure_bytes)
    )


@dataclasses.dataclass
class Point:
    """One (row, size, engines) point: its runs, and what verifying them found."""

    row: str
    op_label: str
    kind: str
    size: int
    engines: int
    prompts: int = 0  # per engine and run
    runs: list[float] = dataclasses.field(default_factory=list)
    lat_s: list[float] = dataclasses.field(default_factory=list)
    verified: int = 0
    mismatches: int = 0
    short: int = 0
    causes: dict[str, int] = dataclasses.field(default_factory=dict)
    evicted: dict[str, int] = dataclasses.field(default_factory=dict)
    error: str = ""

    def add(self, outcomes: Sequence[Outcome]) -> None:
        """One run's outcomes (one per engine). A failed call stops the point; a verification
        failure keeps it running (its count is the finding) but it gets no GB/s."""
        for o in outcomes:
            self.verified += o.verified
            self.mismatches += o.mismatches
            self.short += o.short
            for table, counts in ((self.causes, o.causes), (self.evicted, o.evicted)):
                for key, n in counts.items():
                    table[key] = table.get(key, 0) + n
        errors = [o.error for o in outcomes if o.error]
        if errors:
            self.error = errors[0]
            return
        self.runs.append(aggregate_gbps([(o.t0, o.t1, o.nbytes) for o in outcomes]))
        self.lat_s.extend(x for o in outcomes for x in o.lat_s)

    @property
    def bytes_ok(self) -> bool:
        return self.mismatches == 0 and self.short == 0

    def record(self) -> dict[str, Any]:
        ok = bool(self.runs) and not self.error and self.bytes_ok
        lat = sorted(self.lat_s)
        problem = self.error
        if not self.bytes_ok:
            causes = ", ".join(f"{k} {v}" for k, v in sorted(self.causes.items()))
            problem = f"{self.mismatches} mismatches, {self.short} chunks short" + (
                f" ({causes})" if causes else ""
            )
            problem += f"; {self.error}" if self.error else ""
        return {
            "row": self.row,
            "op": self.op_label,
            "kind": self.kind,
            "size": self.size,
            "engines": self.engines,
            "prompts_per_engine": self.prompts,
            "bytes_per_run": self.prompts * CHUNKS * self.size * self.engines,
            "runs": len(self.runs),
            "gbps": round(statistics.median(self.runs), 3) if ok else None,
            "gbps_runs": [round(r, 3) for r in self.runs],
            "p50_ms": round(percentile(lat, 0.50) * 1e3, 3) if ok and lat else None,
            "p99_ms": round(percentile(lat, 0.99) * 1e3, 3) if ok and lat else None,
            "verified": self.verified,
            "mismatches": self.mismatches,
            "short": self.short,
            "causes": self.causes,
            "evicted": self.evicted,
            "error": problem,
        }


def find(points: Sequence[dict[str, Any]], kind_: str, size: int, engines: int) -> dict[str, Any]:
    for p in points:
        if (p["kind"], p["size"], p["engines"]) == (kind_, size, engines):
            return p
    return {"gbps": None, "error": "not measured", "size": size, "engines": engines, "kind": kind_}


def gbps(points: Sequence[dict[str, Any]], kind_: str, size: int, engines: int) -> float | None:
    value: float | None = find(points, kind_, size, engines)["gbps"]
    return value


def judge(name: str, pairs: Sequence[tuple[int, float | None]], threshold: float) -> dict[str, Any]:
    """A target `ratio ≥ threshold` that must hold at every size: met only when every size was
    measured (verified bytes, no error) and holds it."""
    values = [(s, v) for s, v in pairs if v is not None]
    missing = [size_label(s) for s, v in pairs if v is None]
    if not values:
        return {"target": name, "met": False, "worst": None, "ratios": {}, "detail": "not measured"}
    worst_size, worst = min(values, key=lambda sv: sv[1])
    failing = [size_label(s) for s, v in values if v < threshold]
    detail = f"worst {worst:.2f} at {size_label(worst_size)}"
    if failing:
        detail += f"; missed at {', '.join(failing)}"
    if missing:
        detail += f"; not measured at {', '.join(missing)}"
    return {
        "target": name,
        "met": not failing and not missing,
        "worst": worst,
        "ratios": {str(s): v for s, v in pairs},
        "detail": detail,
    }


def verdicts(
    points: Sequence[dict[str, Any]], sizes: Sequence[int], engines: Sequence[int]
) -> list[dict[str, Any]]:
    """The "Done when" of issue 20, each at every size (1-engine figures; 4-engine ratios are in
    the table), plus 4 engines ÷ 1 engine for every kvfabric row."""

    def over(a: str, b: str, e: int = 1) -> list[tuple[int, float | None]]:
        return [(s, ratio(gbps(points, a, s, e), gbps(points, b, s, e))) for s in sizes]

    out = [
        judge(
            "remote lookup+load+release ≥ 1.0 × Mooncake remote batch_get_into",
            over("remote:lookup_load_release", mooncake_kind("remote", "batch_get_into")),
            1.0,
        ),
        judge(
            "co-located lookup+load+release ≥ 1.0 × Mooncake local batch_get_into",
            over("local:lookup_load_release", mooncake_kind("local", "batch_get_into")),
            1.0,
        ),
        judge(
            "remote save ≥ 1.0 × Mooncake remote batch_put_from",
            over("remote:save", mooncake_kind("remote", "batch_put_from")),
            1.0,
        ),
        judge(
            "co-located save ≥ 1.0 × Mooncake local batch_put_from",
            over("local:save", mooncake_kind("local", "batch_put_from")),
            1.0,
        ),
        judge(
            "co-located save from save memory ≥ 1.0 × Mooncake local batch_put_from",
            over("local:save_memory", mooncake_kind("local", "batch_put_from")),
            1.0,
        ),
        judge("remote load ≥ 0.8 × transport get, tcp", over("remote:load", "tcp_get"), 0.8),
        judge("co-located load ≥ 0.7 × transport get, shm", over("local:load", "shm_get"), 0.7),
    ]
    many = [e for e in engines if e > 1]
    if 1 in engines:
        for e in many:
            for client in CLIENT_LABEL:
                for op in CLIENT_OPS:
                    k = kind(op, client)
                    pairs = [(s, ratio(gbps(points, k, s, e), gbps(points, k, s, 1))) for s in sizes]
                    label = next(r[1] for r in ROWS if r[2] == op)
                    out.append(judge(f"{e} engines ≥ 1 engine, {CLIENT_LABEL[client]} {label}", pairs, 1.0))
    return out


def mooncake_points(result: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """The peer's points (bench/mooncake_peer.py's JSON) in this benchmark's shape. A point whose
    bytes did not all match (or whose TCP check failed) gets no GB/s."""
    out = []
    procs = int(result.get("procs", 1))
    for p in result.get("points", []):
        problems = []
        if p.get("errors"):
            problems.append(f"{p['errors']} errors")
        if p.get("mismatches"):
            problems.append(f"{p['mismatches']} mismatches")
        tcp = p.get("tcp") or {}
        if tcp and not tcp.get("ok", True):
            problems.append(f"TCP check failed (loopback bytes ÷ payload {tcp.get('lo_ratio')})")
        ok = not problems and p.get("gbps") is not None
        out.append(
            {
                "row": f"mooncake {mode}",
                "op": p["op"],
                "kind": mooncake_kind(mode, p["op"]),
                "size": int(p["size"]),
                "engines": procs,
                "gbps": p.get("gbps") if ok else None,
                "gbps_runs": p.get("gbps_runs", []),
                "p50_ms": p.get("p50_ms") if ok else None,
                "p99_ms": p.get("p99_ms") if ok else None,
                "verified": p.get("verified", 0),
                "mismatches": p.get("mismatches", 0),
                "short": p.get("errors", 0),
                "error": "; ".join(problems),
            }
        )
    return out


def bytes_problems(points: Sequence[dict[str, Any]]) -> list[str]:
    """kvfabric, transport and Redis points with a mismatch, a short load or an error: each one
    fails the benchmark (exit 1)."""
    return [
        f"{p['row']} {p['op']} {size_label(p['size'])} ×{p['engines']}: {p['error']}"
        for p in points
        if not p["kind"].startswith("mooncake_") and (p["mismatches"] or p["short"] or p["error"])
    ]


# ---- processes ---------------------------------------------------------------------------------


def read_env_file(path: Path) -> dict[str, str]:
    from kvfabric.ctl.auth import read_env_file as parse

    return parse(path.read_text())


@contextmanager
def local_cluster(
    run: Path, extra_env: Mapping[str, str] | None = None, ssd_bytes: int = 0
) -> Iterator[dict[str, Any]]:
    """`tools/localcluster.py up` with one 4 GiB segment (`extra_env` for every process, e.g. the
    directory's shard count; `ssd_bytes` > 0: a disk tier of that size, its files in `run`/data);
    `down` however the block ends."""
    tool = [sys.executable, str(REPO / "tools" / "localcluster.py")]
    up = [*tool, "up", "--run-dir", str(run), "--nats-port", "0", "--segments", "1"]
    if ssd_bytes > 0:
        up += ["--ssd-bytes", str(ssd_bytes), "--data-dir", str(run / "data")]
    # a segment id of its own: other clusters on this host may run a `seg-1`
    prefix = f"bench-client-{secrets.token_hex(3)}"
    up += ["--segment-bytes", str(SEGMENT_BYTES), "--segment-prefix", prefix]
    # Each engine process holds two clients (remote and co-located) and the transport readers.
    env = dict(os.environ, KVF_SEGMENT_CONNECTIONS_MAX=str(SEGMENT_CONNECTIONS_MAX), **(extra_env or {}))
    try:
        proc = subprocess.run(
            up, capture_output=True, text=True, timeout=CLUSTER_TIMEOUT_S, cwd=REPO, env=env
        )
        state = json.loads((run / "cluster.json").read_text()) if (run / "cluster.json").exists() else {}
        if proc.returncode != 0 or not state.get("ready"):
            raise RuntimeError(f"the local cluster did not start: {(proc.stdout + proc.stderr)[-2000:]}")
        wait_arena_faulted(Path("/dev/shm"), f"kvf-{prefix}-1-", SEGMENT_BYTES)
        yield state
    finally:
        subprocess.run(
            [*tool, "down", "--run-dir", str(run)], capture_output=True, timeout=CLUSTER_TIMEOUT_S, cwd=REPO
        )


STILL_S: Final = 1.0


def wait_arena_faulted(shm_dir: Path, name_prefix: str, size_bytes: int, timeout_s: float = 60.0) -> None:
    """Until the segment's arena file holds all its pages (its prefault thread, on by default, is
    done: KVF_SEGMENT_ARENA_PREFAULT), so that no measurement shares the CPU with it; or until
    its pages stopped growing for `STILL_S` (a segment with the prefault off), or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    held, still_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        arenas = [p for p in shm_dir.glob(name_prefix + "*") if not p.name.endswith(".slots")]
        now_held = sum(p.stat().st_blocks * 512 for p in arenas)
        if arenas and now_held >= size_bytes * len(arenas):
            return
        if now_held != held:
            held, still_since = now_held, time.monotonic()
        elif time.monotonic() - still_since > STILL_S:
            if not arenas:
                print(
                    f"warning: no arena {shm_dir}/{name_prefix}*: not waiting for its prefault",
                    file=sys.stderr,
                )
            return
        time.sleep(0.1)
    print(f"warning: the arena's prefault did not end within {timeout_s:.0f} s", file=sys.stderr)


class Workers:
    """The engine processes, kept for the whole run (replaced after a hang)."""

    def __init__(self, ctx: Any, config: WorkerConfig, count: int, engines: Sequence[int]) -> None:
        self.ctx, self.config, self.count, self.engines = ctx, config, count, engines
        self.working: tuple[int, list[list[bytes]]] | None = None
        self._start()

    def _start(self) -> None:
        # one barrier per concurrent engine count (kept: the children unpickle them after start())
        self.barriers = {e: self.ctx.Barrier(e) for e in self.engines if e > 1}
        self.pipes: list[Any] = []
        self.procs: list[Any] = []
        for i in range(self.count):
            parent, child = self.ctx.Pipe()
            config = dataclasses.replace(self.config, index=i)
            proc = self.ctx.Process(
                target=worker_main, args=(child, self.barriers, config), name=f"engine{i}"
            )
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)
        for i, pipe in enumerate(self.pipes):
            reply = _recv(pipe, WORKER_START_TIMEOUT_S, f"engine {i} start")
            if reply[0] != "ready":
                raise RuntimeError(f"engine {i} did not start: {reply[1]}")
        if self.working is not None:
            self.set_working(*self.working)

    def call(self, i: int, msg: tuple[Any, ...], timeout_s: float) -> tuple[Any, ...]:
        self.pipes[i].send(msg)
        reply: tuple[Any, ...] = _recv(self.pipes[i], timeout_s, f"engine {i} {msg[0]}")
        if reply[0] == "error":
            raise RuntimeError(f"engine {i} {msg[0]}: {reply[1]}")
        return reply

    def set_working(self, size: int, sums: list[list[bytes]]) -> None:
        self.working = (size, sums)
        for i in range(self.count):
            self.call(i, ("set_working", size, sums), RUN_TIMEOUT_S)

    def run(self, tasks: Sequence[Task]) -> list[Outcome]:
        for pipe, task in zip(self.pipes, tasks, strict=False):
            pipe.send(("run", task))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        outcomes = []
        for i, pipe in enumerate(self.pipes[: len(tasks)]):
            reply = _recv(pipe, max(0.0, deadline - time.monotonic()), f"engine {i} run")
            outcomes.append(reply if isinstance(reply, Outcome) else Outcome(error=str(reply[1])[-800:]))
        return outcomes

    def restart(self) -> None:
        self.close(timeout_s=1)
        self._start()

    def close(self, timeout_s: float = 30) -> None:
        for pipe in self.pipes:
            with suppress(OSError):
                pipe.send(None)
        for proc in self.procs:
            _stop(proc, timeout_s)


@dataclasses.dataclass
class Plan:
    sizes: list[int]
    engines: list[int]
    repeats: int
    measure_bytes: int
    working_set_bytes: int
    redis: bool
    idle_wait_max_s: float  # before each round: wait at most this long for an idle machine
    mooncake_engines: list[int]
    ops: tuple[str, ...] = OPS  # the rows measured (`--ops`): every row whose op is one of these


class Bench:
    def __init__(self, workers: Workers, plan: Plan, redis_port: int | None) -> None:
        self.workers = workers
        self.plan = plan
        self.redis_port = redis_port
        self.points: list[dict[str, Any]] = []
        self.sizes: list[dict[str, Any]] = []  # per size: working set, evictions
        self.waited_s: list[float] = []
        self.loadavg: list[str] = []  # at the start of each round, after waiting
        self.run_ids = iter(range(1, 1 << 40))

    def run_size(self, size: int) -> None:
        plan = self.plan
        print(f"size {size_label(size)}", flush=True)
        started = time.monotonic()
        n = prompts_per_run(size, plan.measure_bytes)
        rows = [r for r in ROWS if r[2] in plan.ops and (plan.redis or not r[2].startswith("redis"))]
        count = 0  # the working set: only rows that read need one
        if any(op in READ_OPS for _, _, op, _ in rows):
            count = working_prompts(size, plan.working_set_bytes, max(plan.engines), plan.measure_bytes)
            reply = self.workers.call(0, ("working", size, count), PREPARE_TIMEOUT_S)
            sums, failures = reply[1], reply[2]
            if failures:
                raise RuntimeError(f"could not save the {size_label(size)} working set: {failures}")
            self.workers.set_working(size, sums)
            print(f"  working set: {count} prompts, {count * CHUNKS * size / GiB:.2f} GiB", flush=True)
        points = [
            Point(row, label, kind(op, client), size, e, n)
            for row, label, op, client in rows
            for e in plan.engines
        ]
        ops = {kind(op, client): (op, client) for _, _, op, client in ROWS}
        cursor = 0
        for _ in range(plan.repeats):  # interleaved: a slow spell of the machine hits every point alike
            self.waited_s.append(round(wait_idle(max_wait_s=plan.idle_wait_max_s), 1))
            self.loadavg.append(loadavg())
            for p in points:
                if p.error:
                    continue
                op, client = ops[p.kind]
                run_id = next(self.run_ids)
                tasks = [
                    Task(op, client, size, n, (cursor + i * n) % max(1, count), run_id, p.engines)
                    for i in range(p.engines)
                ]
                cursor += p.engines * n
                try:
                    p.add(self.workers.run(tasks))
                except PointTimeout as exc:  # a hung engine: record, replace the engine processes
                    p.error = str(exc)
                    self.workers.restart()
        evicted = self.workers.call(0, ("evict_working", size, count), PREPARE_TIMEOUT_S)[1] if count else {}
        if self.redis_port is not None:
            import redis

            with redis.Redis(host="127.0.0.1", port=self.redis_port) as r:
                r.flushall()
        self.sizes.append({"size": size, "working_set_prompts": count, "working_set_evicted": evicted})
        for p in points:
            record = p.record()
            self.points.append(record)
            shown = (
                f"{record['gbps']:.2f} GB/s"
                if record["gbps"] is not None
                else f"ERROR {record['error'][:160]}"
            )
            print(f"  {p.row + ' ' + p.op_label:46} x{p.engines}: {shown}", flush=True)
        print(f"  ({time.monotonic() - started:.0f} s)", flush=True)


def run_mooncake(plan: Plan, quick: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Mooncake's points (remote and local, every engine count), and what the runs said; a reason
    instead of points when it cannot be measured."""
    info: dict[str, Any] = {"runs": {}}
    try:
        from bench import mooncake
    except ImportError as exc:
        info["error"] = f"bench/mooncake.py is not importable: {exc}"
        return [], info
    try:
        python = mooncake.setup()
    except Exception as exc:
        python = f"setup failed: {exc!r}"
    if isinstance(python, str):
        info["error"] = python
        return [], info
    points: list[dict[str, Any]] = []
    for mode in MOONCAKE_MODES:
        for procs in plan.mooncake_engines:
            print(f"mooncake {mode}, {procs} process(es)", flush=True)
            try:
                result = mooncake.measure(
                    plan.sizes,
                    CHUNKS,
                    plan.repeats,
                    mode,
                    procs,
                    QUICK_MOONCAKE_TIMEOUT_S if quick else MOONCAKE_TIMEOUT_S,
                    working_set_bytes=plan.working_set_bytes,
                    python=python,
                )
            except Exception as exc:
                result = f"measure failed: {exc!r}"
            key = f"{mode}/{procs}"
            if isinstance(result, str):
                print(f"  not measured: {result[-300:]}", flush=True)
                info["runs"][key] = {"error": result}
                continue
            info["version"] = result.get("version", "unknown")
            info["runs"][key] = {k: v for k, v in result.items() if k != "points"}
            points += mooncake_points(result, mode)
    return points, info


# ---- report ------------------------------------------------------------------------------------


def ratio_cell(
    points: Sequence[dict[str, Any]], p: dict[str, Any], ref: dict[str, str], engines: Sequence[int]
) -> str:
    target = ref.get(p["kind"])
    if target is None:
        return "–"
    return " / ".join(
        fmt(ratio(gbps(points, p["kind"], p["size"], e), gbps(points, target, p["size"], e))) for e in engines
    )


def markdown(result: dict[str, Any]) -> str:
    points, sizes, engines = result["points"], result["sizes"], result["engines"]
    m = result["machine"]
    es = " / ".join(f"{e}e" for e in engines)
    lines = [
        f"### Client API vs Mooncake Store ({result['date']}; {m['cpu']}, {m['cores']} cores, L3 {m['l3']}, "
        f"{m['memory_gib']} GiB, Linux {m['kernel']}, Python {m['python']})",
        "",
        f"`{result['command']}`, {result['elapsed_s']:.0f} s; load average at start / end "
        f"{result['loadavg_start']} / {result['loadavg_end']} (a shared machine). GB/s = 1e9 B/s, median of "
        f"{result['repeats']} interleaved runs; {es} = 1 / 4 engine processes (aggregate GB/s); a prompt = "
        f"{CHUNKS} objects of the size; p50/p99 per prompt call in ms, pooled. Every loaded byte was "
        f"verified: {result['verified_objects']} objects compared, {result['mismatches']} mismatches, "
        f"{result['short']} chunks short. Mooncake {result['mooncake'].get('version', '')}: master + a "
        "separate store process (remote: every byte over its TCP transfer engine) or the client's own "
        "segment (local), in a network namespace of its own.",
        "",
        f"Summary, GB/s with 1 engine ({engines[-1]} engines in brackets):",
        "",
        "| size | remote lookup+load+release | Mooncake remote get_into | co-located lookup+load+release "
        "| Mooncake local get_into | remote save | co-located save | co-located save, save memory "
        "| Mooncake remote put_from | Mooncake local put_from | tcp get | shm get | memcpy | Redis GET |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = (
        "remote:lookup_load_release",
        mooncake_kind("remote", "batch_get_into"),
        "local:lookup_load_release",
        mooncake_kind("local", "batch_get_into"),
        "remote:save",
        "local:save",
        "local:save_memory",
        mooncake_kind("remote", "batch_put_from"),
        mooncake_kind("local", "batch_put_from"),
        "tcp_get",
        "shm_get",
        "memcpy",
        "redis_get",
    )
    for s in sizes:
        cells = [f"{fmt(gbps(points, k, s, 1))} ({fmt(gbps(points, k, s, engines[-1]))})" for k in summary]
        lines.append(f"| {size_label(s)} | {' | '.join(cells)} |")
    lines += [
        "",
        f"| row | op | size | GB/s {es} | {engines[-1]}e ÷ 1e | p50 / p99 ms 1e "
        f"| p50 / p99 ms {engines[-1]}e "
        f"| ÷ Mooncake {es} | ÷ transport get {es} | ÷ Redis {es} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row, label, op, client in (*ROWS, *MOONCAKE_ROWS):
        k = mooncake_kind(client, op) if row.startswith("mooncake") else kind(op, client)
        for s in sizes:
            cols = [find(points, k, s, e) for e in engines]
            if all(c["error"] == "not measured" for c in cols):
                continue
            if all(c["gbps"] is None for c in cols):
                err = next(c["error"] for c in cols if c["error"]).replace("|", "\\|")[:200]
                lines.append(f"| {row} | {label} | {size_label(s)} | error: {err} | | | | | | |")
                continue
            one, many = cols[0], cols[-1]
            lat = [f"{fmt(c.get('p50_ms'), '.2f')} / {fmt(c.get('p99_ms'), '.2f')}" for c in (one, many)]
            lines.append(
                f"| {row} | {label} | {size_label(s)} | {' / '.join(fmt(c['gbps']) for c in cols)} "
                f"| {fmt(ratio(many['gbps'], one['gbps'])) if len(cols) > 1 else '–'} | {lat[0]} | {lat[1]} "
                f"| {ratio_cell(points, one, MOONCAKE_REF, engines)} "
                f"| {ratio_cell(points, one, TRANSPORT_REF, engines)} "
                f"| {ratio_cell(points, one, REDIS_REF, engines)} |"
            )
    lines += [
        "",
        "Targets of issue 20 (1 engine, every size; the 4-engine ratios are in the table):",
        "",
        "| target | " + " | ".join(size_label(s) for s in sizes) + " | verdict |",
        "|---|" + "---:|" * len(sizes) + "---|",
    ]
    for v in result["verdicts"]:
        cells = [fmt(v["ratios"].get(str(s))) for s in sizes]
        verdict = "**met**" if v["met"] else f"**not met** ({v['detail']})"
        lines.append(f"| {v['target']} | {' | '.join(cells)} | {verdict} |")
    if result["problems"]:
        lines += ["", "Bytes not verified (the run failed):", ""] + [f"- {p}" for p in result["problems"]]
    mc = result["mooncake"]
    if mc.get("error"):
        lines += ["", f"Mooncake not measured: {mc['error'][-500:]}"]
    for key, run in mc.get("runs", {}).items():
        if run.get("error"):
            lines += ["", f"Mooncake {key} not measured: {run['error'][-500:]}"]
    if result.get("redis_error"):
        lines += ["", f"Redis not measured: {result['redis_error']}"]
    lines += ["", "Notes: " + "; ".join(result["notes"]) + "."]
    return "\n".join(lines) + "\n"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="object sizes, bytes")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs per point")
    parser.add_argument("--engines", default=",".join(str(e) for e in ENGINES), help="engine process counts")
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 repeat, small measurements: a smoke run")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--ops",
        default=",".join(OPS),
        help="rows to measure, by op (e.g. save,save_async: no working set is saved; the full table "
        "needs them all)",
    )
    parser.add_argument("--stem", default="client", help="result files: <out>/<stem>.json and .md")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ops = tuple(o for o in args.ops.split(",") if o)
    if not ops or set(ops) - set(OPS):
        parser.error(f"--ops: choose from {', '.join(OPS)}")
    engines = sorted({int(e) for e in args.engines.split(",")})
    if not sizes or min(sizes) < 4 * KiB or engines[0] < 1:
        parser.error("sizes must be ≥ 4096 B and engine counts ≥ 1")
    plan = Plan(
        sizes=sizes,
        engines=engines,
        repeats=1 if args.quick else args.repeats,
        measure_bytes=QUICK_MEASURE_BYTES if args.quick else MEASURE_BYTES,
        working_set_bytes=QUICK_WORKING_SET_BYTES if args.quick else WORKING_SET_BYTES,
        redis=not args.no_redis,
        idle_wait_max_s=QUICK_IDLE_WAIT_MAX_S if args.quick else IDLE_WAIT_MAX_S,
        mooncake_engines=engines[:1] if args.quick else engines,  # quick: the peer's 1-process runs
        ops=ops,
    )
    for s in sizes:
        arena = working_prompts(s, plan.working_set_bytes, engines[-1], plan.measure_bytes) * CHUNKS * s
        arena += engines[-1] * prompts_per_run(s, plan.measure_bytes) * CHUNKS * s
        if arena > ARENA_USE_MAX * SEGMENT_BYTES:
            parser.error(f"{size_label(s)}: {arena / GiB:.1f} GiB would not stay under half the arena")
    command = "python -m bench.client" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up (cluster down) on SIGTERM too

    started = time.monotonic()
    load_start = loadavg()
    ctx = mp.get_context("spawn")
    redis_version = ""
    with ExitStack() as stack:
        run = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvf-bench-client-")))
        state = stack.enter_context(local_cluster(run / "cluster"))
        env = read_env_file(Path(state["auth"]["dir"]) / "env" / "tenant-demo.env")
        redis_port: int | None = None
        if plan.redis:
            redis_port, redis_version = stack.enter_context(redis_process())
            plan.redis = redis_port is not None
        ring = max(prompts_per_run(s, plan.measure_bytes) * CHUNKS * s for s in sizes)
        config = WorkerConfig(
            env=env,
            nats_url=state["nats_url"],
            model_id=f"bench-client-{secrets.token_hex(4)}",
            redis_port=redis_port,
            ring_bytes=ring,
            index=0,
        )
        print(f"cluster up ({state['nats_url']}); starting {engines[-1]} engine processes", flush=True)
        workers = Workers(ctx, config, engines[-1], engines)
        stack.callback(workers.close)
        bench = Bench(workers, plan, redis_port)
        for size in sizes:
            bench.run_size(size)
        pids = {name: pid for name, pid in state.get("pids", {}).items() if pid}
        idle_cpu = process_cpu(pids)  # the cluster's processes, every client connected, nothing running
    points = bench.points
    mooncake_info: dict[str, Any] = {"error": "--no-mooncake"}
    if not args.no_mooncake:
        mc_points, mooncake_info = run_mooncake(plan, args.quick)
        points = points + mc_points
    problems = bytes_problems(points)
    ours = [p for p in points if not p["kind"].startswith("mooncake_")]
    result: dict[str, Any] = {
        "bench": "client",
        "date": time.strftime("%Y-%m-%d"),
        "command": command,
        "machine": machine(),
        "versions": versions(redis_version),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "sizes": sizes,
        "engines": engines,
        "repeats": plan.repeats,
        "measure_bytes_per_engine": plan.measure_bytes,
        "working_set_bytes_min": plan.working_set_bytes,
        "segment_bytes": SEGMENT_BYTES,
        "per_size": bench.sizes,
        "cluster_idle_cpu_cores": idle_cpu,
        "busy_wait_s_per_round": bench.waited_s,
        "loadavg_per_round": bench.loadavg,
        "verified_objects": sum(p["verified"] for p in ours),
        "mismatches": sum(p["mismatches"] for p in ours),
        "short": sum(p["short"] for p in ours),
        "problems": problems,
        "redis_error": "" if plan.redis else (redis_version or "--no-redis"),
        "mooncake": mooncake_info,
        "notes": [
            "cluster: tools/localcluster.py (authenticated NATS, 1 directory, 1 segment of "
            f"{SEGMENT_BYTES >> 30} GiB, eviction policy, repair, prefetch), engines as the demo tenant",
            "1 engine = one spawned process; 4 engines meet at a barrier; each engine has a remote "
            "(use_shm=False) and a co-located (use_shm=True) KvClient",
            f"per engine and run: {plan.measure_bytes // MiB} MiB of prompts back to back (≥ 1 prompt); "
            f"loads rotate over a ≥ {plan.working_set_bytes // MiB} MiB working set per size saved "
            "beforehand; saves use fresh prompts, evicted afterwards",
            "load, transport get: lookups before and releases after the timed calls; transport get reads "
            "a hit's 8 objects in one request",
            "every destination is compared with its xxh3-128 checksum after the run (untimed); the first "
            "and last prompt of each save run are loaded back and compared",
            "Mooncake runs after the kvfabric cluster is down; each of its repeats is a pass over a "
            "working set of the same size (it puts, then gets, every key of the pass)",
            "runs of all points of a size are interleaved, each round once the machine is ≥ 85 % idle "
            f"(at most {plan.idle_wait_max_s:.0f} s wait)",
        ],
        "points": points,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    result["verdicts"] = verdicts(points, sizes, engines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out / f"{args.stem}.md").write_text(md)
    print(md)
    print(f"elapsed {result['elapsed_s']} s")
    if problems:
        print(f"FAILED: {len(problems)} points with bytes not verified", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

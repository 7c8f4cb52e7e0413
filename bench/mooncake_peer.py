"""Mooncake Store peer: its Python client measured as a user would use it, for `python -m bench.client`.

Runs with the Mooncake venv's python (`.venv-mooncake/bin/python bench/mooncake_peer.py`; stdlib +
numpy + mooncake only), normally through `bench.mooncake.measure`, which starts it in a fresh network
namespace holding only `lo` (every Mooncake transfer engine listens on 0.0.0.0 and [::]).

- Processes: `mooncake_master` (127.0.0.1, free ports; metadata "P2PHANDSHAKE", no etcd) and, in
  `--mode remote`, a `mooncake_client` store process holding the only segment (3 GiB, or twice the
  working set), while the benchmarking clients mount none (`global_segment_size=0`, protocol tcp): every
  byte crosses the TCP transfer engine. In `--mode local` each benchmarking client mounts its own
  segment and puts there (`ReplicateConfig.preferred_segment` = its own segment); Mooncake then copies
  in-process. `--procs` benchmarking clients, one process each (spawned; aggregate GB/s = all bytes /
  (last end - first start), latencies pooled).
- Ops, one batch call = one "prompt" of `--objects` keys (8): `batch_put_from` / `batch_get_into`
  (zero-copy from/into buffers registered with `register_buffer`), then `put_batch` / `get_batch`
  (bytes copies through the client's local buffer). Each repeat runs the four in that order, each a pass
  over the working set: all processes together put about `--working-set-bytes` (1 GiB) of fresh keys
  per pass, the get pass reads them back in put order (objects not in the CPU caches, 32 MiB L3), and
  `remove_all(force=True)` empties the store after each get pass (a put to an existing key answers 0
  without sending anything, so every put pass uses new keys). One untimed warm-up repeat of the
  zero-copy pair per size touches the store's pages first (Mooncake does not pre-fault its segment).
- Data: key i of a pass holds a window of a random pool at an offset that depends on i and the repeat;
  after every get call (outside the timed region) each object is compared with numpy.array_equal to the
  window it was put from: a wrong, stale or partial object counts as a mismatch; a negative code or a
  short read as an error (then GB/s is null). The pool is one buffer per client, size + 64 B per key
  (puts read it from the CPU caches when it fits, like bench/dataplane.py's one put buffer per client).
- TCP check: the loopback byte counter of the namespace (/proc/self/net/dev; /sys/class/net shows the
  namespace that mounted sysfs, not ours) must grow by ≥ 0.9 × the payload in remote mode and by
  ≤ 0.05 × in local mode, per op and size; recorded in `tcp_check`.
- Each repeat starts once the machine is ≥ 85 % idle over 0.5 s, waiting at most 10 s (others share the
  2 cores); `repeats_started_busy` counts the repeats that started without. GB/s = 1e9 B/s, the median
  repeat; p50/p99 per batch call over all calls of all repeats.

Every process it starts dies with it (PR_SET_PDEATHSIG, and terminate → kill on exit, SIGTERM and
errors); every wait is bounded. Exit 0 with the JSON written (mismatches are recorded, not fatal);
exit 1 with the reason on stderr otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

if __package__ in (None, ""):
    # Run as a script: sys.path[0] is bench/, whose mooncake.py would shadow the mooncake package.
    # Import our helpers as `bench.peerstats` from the repository root instead.
    _BENCH_DIR = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _BENCH_DIR]
    sys.path.insert(0, str(_BENCH_DIR.parent))

from bench.peerstats import (
    OPS,
    GiB,
    MiB,
    PassRecord,
    PeerArgs,
    parse_args,
    plan,
    summarize,
    table,
    tcp_verdict,
)

HOST: Final = "127.0.0.1"
METADATA_SERVER: Final = "P2PHANDSHAKE"
PROTOCOL: Final = "tcp"
STORE_SEGMENT_MIN_BYTES: Final = 3 * GiB
LOCAL_BUFFER_SLACK_BYTES: Final = 16 * MiB
ALIGN_BYTES: Final = 64  # key windows start on cache lines
SLOT_SLACK: Final = 64  # pool windows beyond the keys of a pass, so a repeat's shift gives new content
START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 10.0
BARRIER_TIMEOUT_S: Final = 300.0  # one pass of one process
IDLE_THRESHOLD: Final = 0.85
IDLE_MAX_WAIT_S: Final = 10.0
PR_SET_PDEATHSIG: Final = 1


def die_with_parent() -> None:
    """The kernel sends SIGKILL to this process when the process that started it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def lo_bytes() -> int:
    """Bytes received on this network namespace's loopback (= bytes sent on it)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[0])
    raise RuntimeError("no lo in /proc/self/net/dev")


def interfaces() -> list[str]:
    with open("/proc/self/net/dev") as f:
        return [line.split(":")[0].strip() for line in f if ":" in line]


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def wait_idle(window_s: float = 0.5) -> tuple[float, float]:
    """Wait (≤ IDLE_MAX_WAIT_S) until the machine was ≥ IDLE_THRESHOLD idle over `window_s`: (seconds waited
    beyond the first window, idle share of the last window)."""
    start = time.monotonic()
    idle = 1.0
    while time.monotonic() - start < IDLE_MAX_WAIT_S:
        idle0, total0 = _cpu_times()
        time.sleep(window_s)
        idle1, total1 = _cpu_times()
        idle = 1.0 if total1 == total0 else (idle1 - idle0) / (total1 - total0)
        if idle >= IDLE_THRESHOLD:
            break
    return max(0.0, time.monotonic() - start - window_s), idle


# ---- one benchmarking client (its own process) ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    index: int
    args: PeerArgs
    master_address: str
    segment_bytes: int  # 0: mounts none (remote mode)
    local_buffer_bytes: int


class Client:
    """One MooncakeDistributedStore client with a registered source pool and destination buffer."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        args = cfg.args
        store_mod = importlib.import_module("mooncake.store")
        self.store = store_mod.MooncakeDistributedStore()
        rc = self.store.setup(
            HOST, METADATA_SERVER, cfg.segment_bytes, cfg.local_buffer_bytes, PROTOCOL, "", cfg.master_address
        )
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        self.replicate = store_mod.ReplicateConfig()
        if args.mode == "local":
            self.replicate.preferred_segment = self.store.get_hostname()
        max_size = max(args.sizes)
        self.slots = max(
            plan(s, args.objects, args.procs, args.working_set_bytes) * args.objects for s in args.sizes
        )
        self.slots += SLOT_SLACK
        rng = np.random.default_rng(1000 + cfg.index)
        self.pool = rng.integers(0, 256, max_size + self.slots * ALIGN_BYTES, dtype=np.uint8)
        self.dst = np.full(args.objects * max_size, 0xA5, dtype=np.uint8)  # pre-faulted
        for buf in (self.pool, self.dst):
            rc = self.store.register_buffer(buf.ctypes.data, buf.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer({buf.nbytes} B) returned {rc}")

    def offset(self, i: int, rep: int, family: int) -> int:
        """Pool offset of key i: distinct within a pass, shifted between repeats and op families."""
        return ((i + 13 * (rep + 2) + 5 * family) % self.slots) * ALIGN_BYTES

    def run_pass(self, op: str, size: int, rep: int, prompts: int) -> PassRecord:
        objects = self.cfg.args.objects
        family = 0 if op in ("batch_put_from", "batch_get_into") else 1
        tag = f"w{self.cfg.index}-s{size}-r{rep}-f{family}"
        pool_ptr, dst_ptr = self.pool.ctypes.data, self.dst.ctypes.data
        sizes = [size] * objects
        call_ns: list[int] = []
        errors = mismatches = verified = 0
        start_ns = end_ns = 0
        for p in range(prompts):
            index = range(p * objects, (p + 1) * objects)
            keys = [f"{tag}-{i}" for i in index]
            offs = [self.offset(i, rep, family) for i in index]
            if op == "batch_put_from":
                ptrs = [pool_ptr + o for o in offs]
                t0 = time.perf_counter_ns()
                codes = self.store.batch_put_from(keys, ptrs, sizes, self.replicate)
                t1 = time.perf_counter_ns()
                errors += sum(1 for c in codes if c != 0)
            elif op == "batch_get_into":
                ptrs = [dst_ptr + j * size for j in range(objects)]
                t0 = time.perf_counter_ns()
                codes = self.store.batch_get_into(keys, ptrs, sizes)
                t1 = time.perf_counter_ns()
                errors += sum(1 for c in codes if c != size)
                for j, o in enumerate(offs):
                    same = np.array_equal(self.dst[j * size : (j + 1) * size], self.pool[o : o + size])
                    mismatches += not same
                verified += objects
            elif op == "put_batch":
                t0 = time.perf_counter_ns()
                values = [self.pool[o : o + size] for o in offs]
                code = self.store.put_batch(keys, values, self.replicate)
                t1 = time.perf_counter_ns()
                errors += objects if code != 0 else 0
            elif op == "get_batch":
                t0 = time.perf_counter_ns()
                got = self.store.get_batch(keys)
                t1 = time.perf_counter_ns()
                errors += sum(1 for b in got if len(b) != size) + objects - len(got)
                for b, o in zip(got, offs, strict=False):
                    same = len(b) == size and np.array_equal(
                        np.frombuffer(b, np.uint8), self.pool[o : o + size]
                    )
                    mismatches += not same
                verified += objects
            else:
                raise AssertionError(op)
            if p == 0:
                start_ns = t0
            end_ns = t1
            call_ns.append(t1 - t0)
        return PassRecord(
            start_ns, end_ns, prompts * objects * size, tuple(call_ns), errors, mismatches, verified
        )


def worker_main(cfg: WorkerConfig, barrier: Any, results: Any) -> None:
    """Sends ("ready", i), then per size ("size", i, size, {(rep, op): PassRecord}, lo, waits, removed),
    then ("done", i); ("error", i, text) on any failure."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides
    args = cfg.args
    lead = cfg.index == 0
    try:
        client = Client(cfg)
        results.put(("ready", cfg.index))
        barrier.wait(START_TIMEOUT_S)

        def step(op: str, size: int, rep: int, prompts: int) -> tuple[PassRecord, int]:
            lo0 = lo_bytes() if lead else 0
            barrier.wait(BARRIER_TIMEOUT_S)
            record = client.run_pass(op, size, rep, prompts)
            barrier.wait(BARRIER_TIMEOUT_S)
            return record, (lo_bytes() - lo0 if lead else 0)

        def empty_store() -> int:
            removed = int(client.store.remove_all(True)) if lead else 0
            barrier.wait(BARRIER_TIMEOUT_S)
            return removed

        for size in args.sizes:
            prompts = plan(size, args.objects, args.procs, args.working_set_bytes)
            keys_per_pass = args.procs * prompts * args.objects
            for op in ("batch_put_from", "batch_get_into"):  # warm-up: touch the store's pages
                step(op, size, -1, prompts)
            empty_store()
            records: dict[tuple[int, str], PassRecord] = {}
            lo: dict[str, int] = dict.fromkeys(OPS, 0)
            missing: dict[str, int] = {"batch_put_from": 0, "put_batch": 0}  # keys remove_all did not find
            waits: list[tuple[float, float]] = []
            for rep in range(args.repeats):
                waits.append(wait_idle() if lead else (0.0, 1.0))
                for op in OPS:
                    records[(rep, op)], lo_delta = step(op, size, rep, prompts)
                    lo[op] += lo_delta
                    if op in ("batch_get_into", "get_batch"):
                        removed = empty_store()
                        put_op = "batch_put_from" if op == "batch_get_into" else "put_batch"
                        missing[put_op] += (keys_per_pass - removed) if lead else 0
            results.put(("size", cfg.index, size, records, lo, waits, missing))
        client.store.close()
        results.put(("done", cfg.index))
    except BaseException:
        results.put(("error", cfg.index, traceback.format_exc()))
        with contextlib.suppress(Exception):
            barrier.abort()
        raise SystemExit(1) from None


# ---- the parent: master, store, clients ----------------------------------------------------------


class Stopped(BaseException):
    """SIGTERM / SIGHUP reached the parent: clean up and exit (a BaseException: no `except Exception`
    on the way swallows it)."""


def _on_signal(signum: int, _frame: Any) -> None:
    raise Stopped(f"signal {signum}")


def _tail(path: Path, chars: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


@contextlib.contextmanager
def service(argv: list[str], log: Path, port: int, what: str) -> Iterator[subprocess.Popen[bytes]]:
    """Start a Mooncake binary (dies with us), wait until `port` accepts connections, stop it at exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
            with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what} did not listen on {port} within {START_TIMEOUT_S:.0f} s:\n{_tail(log)}"
                )
            time.sleep(0.05)
        yield proc
    finally:
        _stop_process(proc)


class Workers:
    """The benchmarking clients; `collect` gathers their messages until each said done (bounded)."""

    def __init__(self, configs: list[WorkerConfig]) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(len(configs))
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=worker_main, args=(c, self.barrier, self.results), daemon=True)
            for c in configs
        ]
        for p in self.procs:
            p.start()

    def collect(self, deadline: float) -> list[tuple[Any, ...]]:
        messages: list[tuple[Any, ...]] = []
        done = 0
        while done < len(self.procs):
            try:
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process exited with {dead[0]} without a word") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("clients did not finish before the deadline") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"client {msg[1]} failed:\n{msg[2]}")
            done += msg[0] == "done"
            messages.append(msg)
        return messages

    def close(self, graceful: bool) -> None:
        """Graceful: they said done and exit by themselves; else stop them now (SIGTERM, then SIGKILL)."""
        with contextlib.suppress(Exception):
            self.barrier.abort()
        for p in self.procs:
            p.join(STOP_TIMEOUT_S if graceful else 0)
            if p.is_alive():
                p.terminate()
                p.join(STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(STOP_TIMEOUT_S)
        self.results.close()
        self.results.cancel_join_thread()


def mooncake_version() -> str:
    from importlib import metadata

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{dist} {metadata.version(dist)}"
    return "unknown"


def start_store(stack: contextlib.ExitStack, logs: Path, store_segment_bytes: int) -> str:
    """`mooncake_master` (127.0.0.1, free ports, P2P handshake metadata) and, with
    `store_segment_bytes` > 0, a `mooncake_client` store process holding a segment of that size,
    each stopped when `stack` closes; the master's address."""
    bindir = Path(sys.executable).parent
    master_port, metrics_port, store_port, store_http_port = (free_port() for _ in range(4))
    master_address = f"{HOST}:{master_port}"
    stack.enter_context(
        service(
            [
                str(bindir / "mooncake_master"),
                f"-rpc_address={HOST}",
                f"-rpc_port={master_port}",
                f"-metrics_host={HOST}",
                f"-metrics_port={metrics_port}",
                "-logtostderr",
            ],
            logs / "master.log",
            master_port,
            "mooncake_master",
        )
    )
    if store_segment_bytes > 0:
        stack.enter_context(
            service(
                [
                    str(bindir / "mooncake_client"),
                    f"-host={HOST}",
                    f"-port={store_port}",
                    f"-http_port={store_http_port}",
                    f"-metadata_server={METADATA_SERVER}",
                    f"-master_server_address={master_address}",
                    f"-global_segment_size={store_segment_bytes}",
                    f"-protocol={PROTOCOL}",
                    "-logtostderr",
                ],
                logs / "store.log",
                store_port,
                "mooncake_client (store)",
            )
        )
    return master_address


def run(args: PeerArgs, timeout_s: float) -> dict[str, Any]:
    started = time.monotonic()
    deadline = started + timeout_s
    max_prompt_bytes = args.objects * max(args.sizes)
    per_proc_set = max(
        plan(s, args.objects, args.procs, args.working_set_bytes) * args.objects * s for s in args.sizes
    )
    store_segment_bytes = max(STORE_SEGMENT_MIN_BYTES, 2 * args.procs * per_proc_set)
    client_segment_bytes = 0 if args.mode == "remote" else 2 * per_proc_set + max_prompt_bytes
    local_buffer_bytes = max_prompt_bytes + LOCAL_BUFFER_SLACK_BYTES  # put_batch/get_batch stage through it
    messages: list[tuple[Any, ...]] = []
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mooncake-peer-")))
        master_address = start_store(stack, logs, store_segment_bytes if args.mode == "remote" else 0)
        configs = [
            WorkerConfig(i, args, master_address, client_segment_bytes, local_buffer_bytes)
            for i in range(args.procs)
        ]
        workers = Workers(configs)
        try:
            messages = workers.collect(deadline)
        except BaseException:
            workers.close(graceful=False)
            raise
        workers.close(graceful=True)
    return result(args, messages, store_segment_bytes, client_segment_bytes, local_buffer_bytes, started)


def result(
    args: PeerArgs,
    messages: Sequence[tuple[Any, ...]],
    store_segment_bytes: int,
    client_segment_bytes: int,
    local_buffer_bytes: int,
    started: float,
) -> dict[str, Any]:
    by_size: dict[int, list[tuple[Any, ...]]] = {}
    for msg in messages:
        if msg[0] == "size":
            by_size.setdefault(msg[2], []).append(msg)
    points: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    waits: list[tuple[float, float]] = []
    for size in args.sizes:
        msgs = sorted(by_size[size], key=lambda m: m[1])
        assert len(msgs) == args.procs, (size, len(msgs))
        lead = msgs[0]
        waits += lead[5]
        for op in OPS:
            runs = [[m[3][(rep, op)] for m in msgs] for rep in range(args.repeats)]
            point = {"size": size, "op": op, **summarize(runs)}
            point["keys_missing_at_remove"] = lead[6].get(op, 0)
            payload = sum(r.payload_bytes for records in runs for r in records)
            point["tcp"] = tcp_verdict(args.mode, lead[4][op], payload)
            checks.append({"size": size, "op": op, **point["tcp"]})
            points.append(point)
    ratios = [c["lo_ratio"] for c in checks]
    return {
        "peer": "mooncake-store",
        "version": mooncake_version(),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "mode": args.mode,
        "procs": args.procs,
        "objects": args.objects,
        "repeats": args.repeats,
        "sizes": args.sizes,
        "working_set_bytes": args.working_set_bytes,
        "config": {
            "protocol": PROTOCOL,
            "metadata_server": METADATA_SERVER,
            "store_process": args.mode == "remote",
            "store_segment_bytes": store_segment_bytes if args.mode == "remote" else 0,
            "client_segment_bytes": client_segment_bytes,
            "client_local_buffer_bytes": local_buffer_bytes,
            "preferred_segment": "own" if args.mode == "local" else None,
            "interfaces": interfaces(),
        },
        "tcp_check": {
            "source": "/proc/self/net/dev lo rx_bytes during each pass",
            "expect": "remote: lo_bytes >= 0.9 x payload; local: <= 0.05 x payload",
            "ok": all(c["ok"] for c in checks),
            "min_lo_ratio": min(ratios),
            "max_lo_ratio": max(ratios),
            "points": checks,
        },
        "errors": sum(p["errors"] for p in points),
        "mismatches": sum(p["mismatches"] for p in points),
        "verified": sum(p["verified"] for p in points),
        "keys_missing_at_remove": sum(p["keys_missing_at_remove"] for p in points),
        "idle_wait_s": [round(w, 2) for w, _ in waits],
        "idle_share_at_start": [round(i, 2) for _, i in waits],
        "repeats_started_busy": sum(1 for _, i in waits if i < IDLE_THRESHOLD),
        "points": points,
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    try:
        res = run(args, args.timeout_s)
    except (Exception, Stopped, KeyboardInterrupt) as e:
        print(f"mooncake peer failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(res, indent=2) + "\n")
    print(table(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

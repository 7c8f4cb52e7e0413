"""Where a small save's time goes (issue 20): CPU per cluster process and the client's wall time
per save, over N sync `KvClient.save` calls of 8 objects against a local cluster.

Starts `bench.client.local_cluster` (one segment, eviction policy, repair, prefetch), builds one
`KvClient` as the demo tenant (remote: TCP, or `--shm`: co-located), saves `--saves` fresh prompts
of `--objects` × `--size` (from the client's save memory with `--save-memory`) back to back and
reports, per process of the cluster and for this one,
the CPU it spent per save (`/proc/<pid>/stat` user + system before and after) and the save's p50 /
p90 wall time. `--cprofile FILE` profiles this process's event loop thread (cProfile of the
saves; the save threads are not in it). `--cprofile-service MODULE` profiles the event loop
of the cluster process run as `python -m MODULE` (e.g. `kvfabric.directory`) during the saves
(bench/service_profile_hook on the cluster's `PYTHONPATH`, SIGUSR1/SIGUSR2), written to
`--cprofile-service-out`. `--pyspy NAME` records the named cluster process with
py-spy (`--pyspy-out`, a speedscope file) during the saves. `--json FILE` writes the figures
(bench.save_ab runs this for two revisions, interleaved).

Run: `.venv/bin/python -m bench.client_save_profile [--size 262144] [--saves 200] [--shm]`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from io import BytesIO
from pathlib import Path
from typing import Any, Final

import numpy as np

CLOCK_TICKS_PER_S: Final = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its reaped children so far (0 if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:13]) / CLOCK_TICKS_PER_S


def runs(pid: int, module: str) -> bool:
    """Whether `pid` is `python -m module` (the one bench/service_profile_hook profiles)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(module) and b"-m" in argv[:-1] and argv[argv.index(b"-m") + 1] == module.encode()


# Counters of the save path shown after the run (segment, directory metrics).
COUNTER_WORDS: Final = ('name="receipt', 'name="confirm', 'name="puts', 'endpoint="confirm",outcome')


def scrape(pid: int, words: tuple[str, ...]) -> list[str]:
    """The metric lines of the process's Prometheus endpoint that name one of `words`."""
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    ports = [line.split()[3].rsplit(":", 1)[1] for line in listening.splitlines() if f"pid={pid}," in line]
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except (OSError, ValueError):
            continue
        return [
            line
            for line in text.splitlines()
            if not line.startswith("#") and "_created" not in line and any(w in line for w in words)
        ]
    return []


def client_at(rev: str) -> None:
    """Import `kvfabric.client` as of `rev` from now on (`git archive`; the services, format,
    proto and data plane stay this checkout's). Before anything imports it."""
    repo = Path(__file__).resolve().parents[1]
    blob = subprocess.run(
        ["git", "archive", rev, "libs/client/src/kvfabric/client"], cwd=repo, capture_output=True, check=True
    ).stdout
    into = Path(tempfile.mkdtemp(prefix="kvf-profile-client-"))
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    sys.path.insert(0, str(into / "libs/client/src"))


def timeline(client: Any) -> dict[str, Any]:
    """Marks when a save's put_begin, its writes and its put_commit were answered (perf_counter s
    in `marks["now"]`, one save at a time), by wrapping the client's save-path calls."""
    marks: dict[str, Any] = {}
    aio = client.aio
    shared: Any = getattr(aio, "_shared", None)  # a client before the save table (`--base`)
    gather = asyncio.gather

    async def timed_shared(calls: Any, *args: Any) -> Any:
        reply = await shared(calls, *args)
        name = "begin" if calls is aio._begins else "commit" if calls is aio._commits else "abort"
        marks.setdefault("now", {})[name] = time.perf_counter()
        return reply

    async def timed_gather(*aws: Any, **kw: Any) -> Any:
        result = await gather(*aws, **kw)
        first = result[0] if result else None
        if isinstance(first, list) and first:  # per stream of pipelined writes, its outcomes
            first = first[0]
        # the writes' outcomes: (cause, receipt) per write, or a cause each (a client without receipts)
        if isinstance(first, str) or (
            isinstance(first, tuple) and len(first) == 2 and isinstance(first[0], str)
        ):
            marks.setdefault("now", {})["writes"] = time.perf_counter()
        return result

    if shared is not None:
        aio._shared = timed_shared
    else:  # the save table's shell: one call per effect; the last answer of a kind marks it
        perform = aio._perform_save
        names = {
            "SendBegin": "begin",
            "WriteReplicas": "writes",
            "SendCommit": "commit",
            "SendAbort": "abort",
        }

        async def timed_perform(effect: Any, *args: Any) -> Any:
            event = await perform(effect, *args)
            name = names.get(type(effect).__name__)
            if name is not None:
                marks.setdefault("now", {})[name] = time.perf_counter()
            return event

        aio._perform_save = timed_perform
    aio_asyncio: Any = vars(sys.modules[type(aio).__module__])["asyncio"]
    aio_asyncio.gather = timed_gather  # the module's asyncio: its gathers are timed
    return marks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256 << 10, help="object bytes")
    parser.add_argument("--objects", type=int, default=8, help="objects (chunks) per save")
    parser.add_argument("--saves", type=int, default=200)
    parser.add_argument("--shm", action="store_true", help="co-located client (use_shm=True)")
    parser.add_argument(
        "--save-memory", action="store_true", help="save from the client's save memory (KvClient.save_memory)"
    )
    parser.add_argument("--ssd-bytes", type=int, default=0, help="a disk tier of this size under the segment")
    parser.add_argument("--cprofile", default="", help="write the loop thread's cProfile here")
    parser.add_argument("--cprofile-service", default="", help="cluster module to cProfile")
    parser.add_argument("--cprofile-service-out", default="/tmp/save_service.prof")
    parser.add_argument("--json", default="", help="also write the figures to this JSON file")
    parser.add_argument("--pyspy", default="", help="cluster process to record with py-spy")
    parser.add_argument("--pyspy-out", default="/tmp/save_pyspy.json")
    parser.add_argument(
        "--base", default="", help="git revision of the client to run (default: this checkout's)"
    )
    args = parser.parse_args()
    if args.base:
        client_at(args.base)
    if args.cprofile_service:  # the cluster's processes inherit this environment
        hook = Path(__file__).resolve().parent / "service_profile_hook"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
        os.environ["KVF_PROFILE_SERVICE"] = args.cprofile_service
        os.environ["KVF_PROFILE_SERVICE_OUT"] = str(Path(args.cprofile_service_out).resolve())
    from bench.client import local_cluster, read_env_file
    from bench.client_worker import bench_spec
    from kvfabric.client import KvClient, settings_from_env

    with (
        tempfile.TemporaryDirectory(prefix="kvf-save-profile-") as tmp,
        local_cluster(Path(tmp), ssd_bytes=args.ssd_bytes) as state,
    ):
        env = read_env_file(Path(state["auth"]["dir"]) / "env" / "tenant-demo.env")
        settings = settings_from_env(env, nats_url=state["nats_url"], use_shm=args.shm)
        spec = bench_spec(env, state["nats_url"], f"profile-{secrets.token_hex(4)}")
        client = KvClient(settings, spec)
        if not client.enabled:
            raise RuntimeError("the client could not reach the cluster")
        rng = np.random.default_rng(7)
        pool = rng.integers(0, 255, args.size * args.objects * 4, dtype=np.uint8)
        if args.save_memory:  # the engine gathers its KV into the client's save memory
            memory = client.save_memory(pool.nbytes)
            memory.view[:] = pool.data
            pool = np.frombuffer(memory.view, np.uint8)
        tokens_per_chunk = spec.layout.tokens_per_chunk

        def prompt(i: int) -> tuple[list[int], list[list[memoryview]]]:
            tokens = [1_000_000 + i, args.size, 7, 9, *range(tokens_per_chunk * args.objects - 4)]
            start = (i % 3) * args.size
            views = [
                [memoryview(pool[start + c * args.size : start + (c + 1) * args.size])]
                for c in range(args.objects)
            ]
            return tokens, views

        phases = timeline(client)
        for i in range(20):  # warm up: connections, staging files, the directory's tables
            client.save(*prompt(i))
        pids = {name: pid for name, pid in state["pids"].items() if pid}
        pids["client"] = os.getpid()
        spy = None
        if args.pyspy:
            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "-p",
                    str(pids[args.pyspy]),
                    "-o",
                    args.pyspy_out,
                    "-f",
                    "speedscope",
                    "-r",
                    "200",
                    "-d",
                    "600",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
        profiled = [
            pid for name, pid in pids.items() if name != "client" and runs(pid, args.cprofile_service)
        ]
        for pid in profiled:
            os.kill(pid, signal.SIGUSR1)
        before = {name: cpu_s(pid) for name, pid in pids.items()}
        load_before = os.getloadavg()
        prof = cProfile.Profile() if args.cprofile else None
        walls: list[float] = []
        failed = 0
        causes: collections.Counter[str] = collections.Counter()
        t0 = time.perf_counter()
        for i in range(args.saves):
            tokens, views = prompt(1000 + i)
            s = time.perf_counter()
            if prof is not None:
                prof.enable()
            result = client.save(tokens, views)
            if prof is not None:
                prof.disable()
            walls.append(time.perf_counter() - s)
            for name, at in phases.pop("now", {}).items():
                phases.setdefault(name, []).append((at - s) * 1e3)
            failed += result.chunks_failed
            causes.update(result.causes)
        elapsed = time.perf_counter() - t0
        after = {name: cpu_s(pid) for name, pid in pids.items()}
        for pid in profiled:
            os.kill(pid, signal.SIGUSR2)
        counters = {name: scrape(pids[name], COUNTER_WORDS) for name in ("segment-1", "directory")}
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        client.close()
        if prof is not None:
            prof.dump_stats(args.cprofile)
    walls.sort()
    offered = args.saves * args.objects * args.size
    where = ("co-located" if args.shm else "remote") + (", save memory" if args.save_memory else "")
    stored = (args.saves * args.objects - failed) * args.size  # a failed chunk moved no bytes
    print(
        f"{args.saves} saves of {args.objects} x {args.size} B ({where}): "
        f"{elapsed:.2f} s, {offered / elapsed / 1e9:.3f} GB/s offered, {stored / elapsed / 1e9:.3f} stored, "
        f"p50 {statistics.median(walls) * 1e3:.2f} ms, "
        f"p90 {walls[int(0.9 * len(walls))] * 1e3:.2f} ms, chunks failed {failed} {dict(causes)}; "
        f"load {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    total = 0.0
    for name in sorted(pids, key=lambda n: before[n] - after[n]):
        per_save_ms = (after[name] - before[name]) / args.saves * 1e3
        total += per_save_ms
        print(f"  {name:16} {per_save_ms:6.2f} ms CPU per save")
    print(f"  {'all':16} {total:6.2f} ms CPU per save")
    for name in ("begin", "writes", "commit"):
        marks = sorted(phases.get(name, []))
        if marks:
            print(f"  {name:8} answered at p50 {statistics.median(marks):6.2f} ms from the call")
    for name, lines in counters.items():
        print(f"  {name}: " + "; ".join(lines))
    if args.json:
        figures = {
            "saves": args.saves,
            "objects": args.objects,
            "size": args.size,
            "shm": args.shm,
            "save_memory": args.save_memory,
            "p50_ms": statistics.median(walls) * 1e3,
            "p90_ms": walls[int(0.9 * len(walls))] * 1e3,
            "cpu_ms_per_save": {n: (after[n] - before[n]) / args.saves * 1e3 for n in pids},
            "chunks_failed": failed,
            "elapsed_s": elapsed,
            "stored_gb_per_s": stored / elapsed / 1e9,
            "load": [load_before[0], os.getloadavg()[0]],
        }
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

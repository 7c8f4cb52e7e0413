"""The disk tier in chaos drills (issue 23): what tools/chaos.py needs for the drills
segment-kill-during-demotion, ssd-full and cluster-power-cycle.

- `topology.ssd_bytes`: every segment gets a disk tier of that many bytes (`localcluster.py up
  --ssd-bytes`), in a data folder of the drill's own outside its run folder (`--data-dir`: a
  power cycle's second `up` cleans the run folder, the data folder must stay), removed after.
- fault `kill_demoting` (target `segment-<i>`, `min_demotions`, `timeout_s`): SIGKILL the segment
  once its `demotions` counter reached `min_demotions` (its metrics), while the eviction policy
  still demotes; the supervisor restarts it on its disk file.
- fault `power_cycle`: note which chunks are findable on disk (a lookup lists a disk replica for
  the chunk and for every chunk before it: a lookup folds from chunk 0), SIGKILL the supervisor
  and every child (nats-server last), wait until the NATS port can be bound again (the workload's
  client reconnects to the same address; localcluster picks another port while a TIME_WAIT
  socket holds it), `up` again on the same run and data folders, then count the chunks noted
  whose disk replica (segment, slot, slot generation) a lookup lists again and that load with
  identical bytes (the workload saves again what it misses and the policy demotes that again: a
  chunk found only in a new arena or disk copy is not counted).
- after settle, per live segment: disk objects and bytes (its metrics) against the disk replicas
  the directory lists on it, and its counters (`demotions`, `demote_no_capacity`,
  `ssd_read_corrupt`, `ssd_recovered_objects`).

The checkers on these figures are pure functions in tools/chaos_checks.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KILL_WAIT_S = 30.0  # every SIGKILLed process gone
PORT_WAIT_S = 90.0  # the NATS port bindable again (TIME_WAIT lasts 60 s on Linux)
ADOPT_WAIT_S = 60.0  # after `up`: the directory adopts what each segment recovered
POLL_S = 0.25
SEGMENT_COUNTERS = ("demotions", "demote_no_capacity", "ssd_read_corrupt", "ssd_recovered_objects")


def log_event(path: Path, event: str) -> dict[str, Any] | None:
    """The last JSON log record of `event` in a child's log (None: not logged yet)."""
    found = None
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"{event}"' in line:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("event") == event:
                    found = record
    return found


def segment_metrics(run: Path, child: str) -> str | None:
    """The metrics exposition of the running `segment-<i>` (its last start's metrics port)."""
    from kvfabric.testing import scrape_metrics

    started = log_event(run / "logs" / f"{child}.log", "segment_started")
    if not started or not started.get("metrics_port"):
        return None
    try:
        return scrape_metrics(int(started["metrics_port"]))
    except OSError:  # killed, or not serving yet
        return None


def segment_figures(text: str) -> dict[str, float]:
    from kvfabric.testing import metric_value

    figures = {
        "ssd_objects": metric_value(text, "kvfabric_segment_tier_objects", tier="ssd") or 0.0,
        "ssd_bytes": metric_value(text, "kvfabric_segment_tier_bytes", tier="ssd") or 0.0,
    }
    for name in SEGMENT_COUNTERS:
        figures[name] = metric_value(text, "kvfabric_segment_events_total", name=name) or 0.0
    return figures


def disk_replicas_listed(nats_url: str, admin: dict[str, str]) -> dict[str, tuple[int, int]]:
    """Per segment id: the disk replicas every directory shard lists on it (objects, bytes)."""
    import asyncio

    import nats

    from kvfabric.cluster.natsauth import nats_auth_from_env
    from kvfabric.ctl import queries
    from kvfabric.proto import directory as m
    from kvfabric.proto.segment import tier_of_slot

    async def ask() -> dict[str, tuple[int, int]]:
        nc = await nats.connect(nats_url, **nats_auth_from_env(admin).connect_options())
        try:
            router = await queries.router(nc)
            groups = await router.list_groups(m.ListGroups(limit=1000, with_objects=True), 5, 100_000)
        finally:
            await nc.close()
        out: dict[str, tuple[int, int]] = {}
        for g in groups:
            for o in g.objects:
                for r in o.replicas:
                    if tier_of_slot(r.slot) == "ssd":
                        n, size = out.get(r.segment_id, (0, 0))
                        out[r.segment_id] = (n + 1, size + o.size_bytes)
        return out

    return asyncio.run(ask())


DiskIds = list[set[tuple[str, int, int]]]  # per chunk: its disk replicas (segment, slot, generation)


def findable_on_disk(on_disk: DiskIds) -> int:
    """Chunks a lookup can find on disk alone: from chunk 0, each with a disk replica."""
    n = 0
    while n < len(on_disk) and on_disk[n]:
        n += 1
    return n


def adopted_on_disk(before: DiskIds, after: DiskIds, identical: int) -> int:
    """Of the chunks findable on disk before (`before`, from chunk 0), how many from chunk 0 are
    listed after with one of the same disk replicas (adopted, not written anew) and loaded with
    identical bytes (`identical`: chunks from chunk 0 that did)."""
    n = 0
    while n < min(len(before), len(after), identical) and before[n] & after[n]:
        n += 1
    return n


class SsdDrill:
    """One drill's disk-tier part (nothing for a drill without `topology.ssd_bytes`)."""

    def __init__(self, name: str, topo: dict[str, Any]) -> None:
        self.ssd_bytes = int(topo.get("ssd_bytes", 0))
        self.segments = int(topo.get("segments", 3))
        self.data = Path(tempfile.mkdtemp(prefix=f"kvf-chaos-{name}-data-")) if self.ssd_bytes else None
        self.up_argv: list[str] = []
        self.env: dict[str, str] = {}
        self.chunks = 8
        self.prompt: Callable[[int, int], list[int]] | None = None
        self.payload: Callable[[bytes, int], bytes] | None = None
        self.chunk_bytes = 64 << 10
        self.prefixes = 0
        self.tokens_per_chunk = 16
        self.findable: dict[int, int] = {}  # power cycle: prefix -> chunks findable on disk before it
        self.disk_ids: dict[int, DiskIds] = {}  # ... their disk replicas
        self.hit_after: dict[int, int] = {}  # ... of them listed on disk and identical after it
        self.cycle: dict[str, Any] = {}
        self.disk: list[dict[str, Any]] = []  # per live segment after settle

    def up_args(self) -> list[str]:
        if not self.data:
            return []
        return ["--ssd-bytes", str(self.ssd_bytes), "--data-dir", str(self.data)]

    def prepare(
        self,
        up_argv: list[str],
        env: dict[str, str],
        wl: dict[str, Any],
        prompt: Callable[[int, int], list[int]],
        payload: Callable[[bytes, int], bytes],
        tokens_per_chunk: int,
    ) -> None:
        self.up_argv, self.env = list(up_argv), dict(env)
        self.chunks = int(wl.get("chunks_per_prefix", 8))
        self.chunk_bytes = int(wl.get("chunk_bytes", 64 << 10))
        self.prefixes = int(wl.get("prefixes", 10))
        self.prompt, self.payload, self.tokens_per_chunk = prompt, payload, tokens_per_chunk

    def fire(self, run: Path, fault: dict[str, Any], kv_factory: Any) -> str:
        if fault["action"] == "kill_demoting":
            return self.kill_demoting(run, fault)
        return self.power_cycle(run, fault, kv_factory)

    def kill_demoting(self, run: Path, fault: dict[str, Any]) -> str:
        target = str(fault.get("target", "segment-1"))
        wanted = float(fault.get("min_demotions", 3))
        deadline = time.monotonic() + float(fault.get("timeout_s", 30.0))
        demotions = 0.0
        while True:
            text = segment_metrics(run, target)
            demotions = segment_figures(text)["demotions"] if text else 0.0
            if demotions >= wanted:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{target} demoted {demotions:.0f} objects, not {wanted:.0f}, in time")
            time.sleep(POLL_S / 5)
        pid = json.loads((run / "cluster.json").read_text())["pids"].get(target)
        os.kill(pid, signal.SIGKILL)
        return f"kill {target} (pid {pid}) after {demotions:.0f} demotions"

    # -- power cycle --------------------------------------------------------------------------

    def _chunks(self, kv: Any, prefix: int) -> tuple[DiskIds, int]:
        """(per chunk a lookup finds: its disk replicas (segment, slot, slot generation), chunks
        loaded with identical bytes from the first on)."""
        from kvfabric.proto.segment import tier_of_slot

        assert self.prompt is not None and self.payload is not None
        tokens = self.prompt(prefix, self.chunks * self.tokens_per_chunk + 1)
        hit = kv.lookup(tokens, max_tokens=len(tokens) - 1)
        try:
            on_disk = [
                {
                    (r.segment_id, r.slot, r.slot_generation)
                    for r in o[0].replicas
                    if tier_of_slot(r.slot) == "ssd"
                }
                for o in hit.objects
            ]
            dests = [[bytearray(self.chunk_bytes)] for _ in range(hit.chunks)]
            loaded = kv.load(hit, dests).tokens // self.tokens_per_chunk
        finally:
            kv.release(hit)
        groups = kv.aio.chunk_groups(tokens)
        identical = 0
        while identical < loaded and bytes(dests[identical][0]) == self.payload(
            groups[identical].to_bytes(), self.chunk_bytes
        ):
            identical += 1
        return on_disk, identical

    def power_cycle(self, run: Path, fault: dict[str, Any], kv_factory: Any) -> str:
        with kv_factory() as kv:
            for prefix in range(self.prefixes):
                on_disk, _ = self._chunks(kv, prefix)
                n = findable_on_disk(on_disk)
                if n:
                    self.findable[prefix], self.disk_ids[prefix] = n, on_disk[:n]
        state = json.loads((run / "cluster.json").read_text())
        port = int(state["nats_url"].rsplit(":", 1)[1])
        pids = [int((run / "supervisor.pid").read_text())]  # first: it would restart its children
        pids += [p for name, p in state["pids"].items() if p and name != "nats"]
        pids += [state["pids"]["nats"]]  # last: the others' connections close on their side
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for pid in pids:
            while Path(f"/proc/{pid}").exists():
                if time.monotonic() - killed_at > KILL_WAIT_S:
                    raise RuntimeError(f"pid {pid} outlived SIGKILL")
                time.sleep(0.05)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from localcluster import port_free  # type: ignore[import-not-found]

        while not port_free(port) and time.monotonic() - killed_at < PORT_WAIT_S:
            time.sleep(POLL_S * 4)
        port_wait_s = time.monotonic() - killed_at
        kept = Path(tempfile.mkdtemp(prefix="kvf-chaos-cycle-logs-"))  # `up` cleans the run folder
        if (run / "logs").is_dir():
            shutil.move(str(run / "logs"), str(kept / "logs"))
        argv = list(self.up_argv)
        argv[argv.index("--nats-port") + 1] = str(port)
        started = time.monotonic()
        up = subprocess.run(argv, env=self.env, capture_output=True, text=True)
        up_s = time.monotonic() - started
        for path in sorted((kept / "logs").glob("*")) if (kept / "logs").is_dir() else []:
            (run / "logs").mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), str(run / "logs" / f"before-cycle-{path.name}"))  # counted too
        shutil.rmtree(kept, ignore_errors=True)
        if up.returncode != 0:
            raise RuntimeError(f"up after the power cycle failed: {(up.stdout + up.stderr)[-800:]}")
        new_url = json.loads((run / "cluster.json").read_text())["nats_url"]
        expected = sum(self.findable.values())
        deadline = time.monotonic() + ADOPT_WAIT_S
        with kv_factory() as kv:
            while True:
                for prefix in self.findable:
                    on_disk, identical = self._chunks(kv, prefix)
                    self.hit_after[prefix] = adopted_on_disk(self.disk_ids[prefix], on_disk, identical)
                if sum(self.hit_after.values()) >= expected or time.monotonic() > deadline:
                    break
                time.sleep(POLL_S * 2)
        hit = sum(self.hit_after.values())
        self.cycle = {
            "findable_before": expected,
            "hit_after": hit,
            "port_wait_s": round(port_wait_s, 1),
            "up_s": round(up_s, 1),
            "measured_s": round(time.monotonic() - started, 1),
            "same_nats_url": new_url == state["nats_url"],
        }
        return (
            f"power cycle: every process SIGKILLed, port free after {port_wait_s:.0f} s, up in {up_s:.0f} s"
            f"{'' if new_url == state['nats_url'] else ' ON ANOTHER PORT'}; {hit} of {expected} chunks "
            f"findable on disk before hit from disk with identical bytes"
        )

    # -- after settle -------------------------------------------------------------------------

    def read_final(self, run: Path, nats_url: str, admin: dict[str, str]) -> None:
        if not self.data:
            return
        state = json.loads((run / "cluster.json").read_text())
        prefix = state.get("segment_prefix", "seg")
        listed = disk_replicas_listed(nats_url, admin)
        for i in range(1, self.segments + 1):
            text = segment_metrics(run, f"segment-{i}")
            if text is None:
                continue
            figures = segment_figures(text)
            n, size = listed.get(f"{prefix}-{i}", (0, 0))
            self.disk.append(dict(segment_id=f"{prefix}-{i}", listed_objects=n, listed_bytes=size, **figures))

    def violations(
        self, final_unknown: bool, log_counts: dict[str, int], expect: dict[str, Any]
    ) -> dict[str, list[str]]:
        """The disk-tier checkers (tools/chaos_checks.py) on this drill's figures."""
        from chaos_checks import check_demotion, check_disk_tier, check_power_cycle  # type: ignore[import-not-found]

        share_min, findable_min = (
            expect.get("power_cycle_share_min"),
            int(expect.get("power_cycle_findable_min", 1)),
        )
        return {
            "disk_tier": [] if final_unknown else check_disk_tier(self.disk),
            "demotion": check_demotion(self.disk, log_counts, expect),
            "power_cycle": check_power_cycle(self.cycle, share_min, findable_min),
        }

    def summary(self) -> dict[str, Any]:
        return {"disk": self.disk, "power_cycle": self.cycle} if self.data else {}

    def close(self) -> None:
        if self.data:
            shutil.rmtree(self.data, ignore_errors=True)

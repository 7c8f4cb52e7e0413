"""Clock skew for `make chaos` (issue 27): extra cluster children whose wall clock is off.

A drill names them in `[topology]`:

    skewed = [{ kind = "directory", offset_s = -5 }, { kind = "segment", offset_s = 5 }]
    extra = [{ kind = "directory", nats_node = 2 }]   # no skew, on another NATS node

Each is one more instance of its kind, built exactly as tools/localcluster.py builds the others
(`plan_children` with one more of that kind: same credentials, same settings), started by the
drill runner after the cluster is up under libfaketime (`apt-get install faketime`):
`LD_PRELOAD=libfaketimeMT.so.1 FAKETIME=<offset> FAKETIME_DONT_FAKE_MONOTONIC=1`. Only the
wall clock (`time.time`, CLOCK_REALTIME) is off: monotonic clocks are per host anyway and
never compared across processes, so skewing them would test nothing a real cluster meets.
A skewed directory needs `directories >= 2` (rebalancing over 16 shards: it takes its share by
handover); a skewed segment registers as segment `<prefix>-<N+1>` in its own failure domain.

`extra = [...]` adds instances the same way without a skew (`offset_s` left out), e.g. on
another node of the drill's NATS cluster (`nats_node`, tools/chaos_natscluster.py).

`Skewed.start` returns once each extra child logged its start, the directory lists every
segment up and every extra directory leads shards; a watcher restarts an extra child that
exits (a directory whose leases lapsed exits 75 and must come back, as localcluster's
supervisor does for its own). `close` (the runner's `finally`) stops them (SIGTERM, then
SIGKILL past the stop timeout), removes a killed segment's shared-memory files and returns what
it left behind (must be nothing). localcluster's supervisor does not know them: faults do not
name them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent))

import localcluster  # type: ignore[import-not-found]

__all__ = ["FAKETIME_LIB", "Skewed"]

FAKETIME_LIB: Final = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"
READY_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 10.0
POLL_S: Final = 0.2
RESTART_WAIT_S: Final = 0.5


def faketime_env(offset_s: float) -> dict[str, str]:
    if not Path(FAKETIME_LIB).exists():
        raise RuntimeError(f"{FAKETIME_LIB} not found: apt-get install faketime")
    return {
        "LD_PRELOAD": FAKETIME_LIB,
        "FAKETIME": f"{offset_s:+g}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
    }


class Skewed:
    """The skewed extra children of one drill."""

    def __init__(self) -> None:
        self.children: list[Any] = []  # localcluster.Child
        self.segment_prefix = "seg"
        self.described: list[str] = []
        self.restarts = 0
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(
        self,
        run: Path,
        state: dict[str, Any],
        topo: dict[str, Any],
        env: dict[str, str] | None = None,
        nats_urls: dict[int, str] | None = None,
    ) -> None:
        """`env`: the settings the cluster was brought up with (KVF_* beyond this process's own
        environment, e.g. the drill's replica count), given to the extra children too.
        `nats_urls`: node -> URL of the drill's other NATS nodes (`nats_node` of a spec)."""
        specs = list(topo.get("skewed", [])) + list(topo.get("extra", []))
        if not specs:
            return
        segments, directories = int(topo.get("segments", 3)), int(topo.get("directories", 1))
        extra_segments = [s for s in specs if s["kind"] == "segment"]
        extra_directories = [s for s in specs if s["kind"] == "directory"]
        if extra_directories and directories < 2:
            raise ValueError("a skewed directory needs directories >= 2 (16 shards, rebalancing)")
        self.segment_prefix = state.get("segment_prefix", "seg")
        kwargs: dict[str, Any] = {}
        if "data" in inspect.signature(localcluster.plan_children).parameters and state.get("data_dir"):
            kwargs["data"] = Path(state["data_dir"])
        planned, _ = localcluster.plan_children(
            run,
            int(state["nats_url"].rsplit(":", 1)[1]),
            segments + len(extra_segments),
            int(topo.get("segment_bytes", 256 << 20)),
            self.segment_prefix,
            directories + len(extra_directories),
            int(topo.get("netns_segments", 0)),
            **kwargs,
        )
        by_name = {c.name: c for c in planned}
        chosen = [(f"segment-{segments + 1 + i}", s) for i, s in enumerate(extra_segments)]
        chosen += [(f"directory-{directories + 1 + i}", s) for i, s in enumerate(extra_directories)]
        logs = run / "logs"
        for name, spec in chosen:
            child = by_name[name]
            extra = {k: v for k, v in (env or {}).items() if k.startswith("KVF_") and os.environ.get(k) != v}
            child.env = dict(child.env, **extra)
            said = []
            if "offset_s" in spec:
                child.env.update(faketime_env(float(spec["offset_s"])))
                said.append(f"{float(spec['offset_s']):+g} s")
            if "nats_node" in spec:  # connect to another node of the drill's NATS cluster
                url = (nats_urls or {})[int(spec["nats_node"])]
                child.argv = [
                    url if prev == "--nats-url" else a
                    for prev, a in zip(["", *child.argv[:-1]], child.argv, strict=True)
                ]
                said.append(f"on nats-{spec['nats_node']}")
            child.name = f"{name}-extra"  # its own log file
            child.start(logs)
            self.children.append(child)
            self.described.append(f"{name} {' '.join(said)}")
        deadline = time.monotonic() + READY_TIMEOUT_S
        for child in self.children:
            while not child.ready(logs):
                if time.monotonic() > deadline or child.proc.poll() is not None:
                    raise RuntimeError(f"{child.name} did not start (see logs/{child.name}.log)")
                time.sleep(POLL_S)
        self._watcher = threading.Thread(target=self._watch, args=(logs,), daemon=True)
        self._watcher.start()
        want_segments = segments + len(extra_segments)
        want_instances = {f"directory-{directories + 1 + i}" for i in range(len(extra_directories))}
        reason = ""
        while time.monotonic() < deadline:
            reason = asyncio.run(self._joined(state, want_segments, want_instances))
            if not reason:
                return
            time.sleep(0.5)
        raise RuntimeError(f"skewed children did not join: {reason}")

    @staticmethod
    async def _joined(state: dict[str, Any], segments: int, instances: set[str]) -> str:
        """'' once every segment is up and every instance in `instances` leads a shard."""
        import nats

        from kvfabric.cluster.directory_router import DirectoryRouter
        from kvfabric.cluster.natsauth import nats_auth_from_env

        admin = (state.get("auth") or {}).get("admin_env") or {}
        nc = await nats.connect(state["nats_url"], **nats_auth_from_env(admin).connect_options())
        try:
            router = DirectoryRouter(nc)
            await router.refresh()
            if not router.complete:
                return f"shards led {len(router.routes)}/{router.shards}"
            missing = instances - set(router.instances())
            if missing:
                return f"{', '.join(sorted(missing))} leads no shard yet"
            up = [s for s in (await router.segments(5.0)).segments if s.up]
            if len(up) < segments:
                return f"segments up {len(up)}/{segments}"
        except Exception as exc:  # ask again
            return f"{type(exc).__name__}: {exc}"
        finally:
            await nc.close()
        return ""

    def _watch(self, logs: Path) -> None:
        """Restart an extra child that exited (a directory whose leases lapsed exits 75 and
        must come back, as localcluster's supervisor does for its own), until close()."""
        while not self._stopping.wait(POLL_S):
            for child in self.children:
                if child.proc is not None and child.proc.poll() is not None and not self._stopping.is_set():
                    if self._stopping.wait(RESTART_WAIT_S):
                        return
                    child.start(logs)
                    self.restarts += 1

    def close(self) -> list[str]:
        """Stop every extra child; what is left (pids still alive, shared-memory files)."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(STOP_TIMEOUT_S)
        for child in self.children:
            child.stop()  # SIGTERM, then SIGKILL past localcluster's stop timeout
        left = []
        for child in self.children:
            proc = child.proc
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(STOP_TIMEOUT_S)
                if proc.poll() is None:
                    left.append(f"process {child.name} (pid {proc.pid})")
            if child.name.startswith("segment-"):
                number = child.name.removeprefix("segment-").removesuffix("-extra")
                for path in Path("/dev/shm").glob(f"kvf-{self.segment_prefix}-{number}[-.]*"):
                    with contextlib.suppress(OSError):
                        path.unlink()
                left += [
                    f"file {p}" for p in Path("/dev/shm").glob(f"kvf-{self.segment_prefix}-{number}[-.]*")
                ]
        self.children.clear()
        return left

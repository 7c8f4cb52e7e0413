"""A local kvfabric cluster on loopback, no docker: `make up` / `make down` (and `status`).

    python tools/localcluster.py up     [--run-dir .run] [--nats-port 4222] [--segments 3]
                                        [--ssd-bytes N] [--data-dir .data]
    python tools/localcluster.py status [--run-dir .run]
    python tools/localcluster.py down   [--run-dir .run]

`up` starts a supervisor in the background and returns once the cluster takes reads and writes
(below). The supervisor owns every child: nats-server (JetStream, store under the run folder),
one directory (plus `--directories - 1` standbys, `directory-<i>`), N segments in N distinct
failure domains (zone-<i>/rack-<i>/host-<i>), and the eviction-policy, repair and prefetch
services. A child that exits is restarted after a backoff (`restart_wait_s`: 0.2 s doubling up to
`RESTART_WAIT_S_MAX`, counted over `RESTART_WINDOW_S`). nats-server and the directories are never
given up on: a directory whose lease lapsed exits (75, or 79 when its stop overran) and must come
back, or the cluster stays down. Any other child that failed more than `RESTARTS_MAX` times in
`RESTART_WINDOW_S` stays down and the supervisor says so (`given_up` in `cluster.json`); exits
with 75 (a segment the directory declared down comes back empty under a new incarnation) are
asked-for restarts and never count. `down` stops the supervisor (SIGTERM: children stopped in
reverse order, then killed if they hang) and deletes the run folder: no process and no run file
is left behind.

Ready means usable (issue 22): after every child logged its start, the supervisor runs
`localcluster.py probe` until it passes or `READY_TIMEOUT_S` ends: every shard has a leader, all
N segments are registered and up, and a client of the first tenant saves `PROBE_CHUNKS` small
chunks, looks them up and loads them back byte for byte (model id `kvfabric-ready-probe`, a few
KiB that eviction reclaims like any object). Only then is `ready` written; `up` returns 0, or 1
with the probe's last reason ("segments up 2/3", "probe save: busy 4", ...).

Logs: `logs/<name>.log`, JSON lines at info level (per-request lines are debug: set
`KVF_LOG_LEVEL=debug` before `up` to see them). Each file is rotated by the supervisor when it
passes `LOG_FILE_BYTES_MAX` (copied to `<name>.log.1`, older ones shifted, at most
`LOG_FILES_KEPT`, then truncated in place: children write with O_APPEND, so they go on at its
start; lines written during the copy may be lost).

Authenticated by default (issue "Tenancy and security", docs/security.md): `up` runs
`kvctl auth init` into the data folder's `auth/` (below: once, then kept), a NATS user per
service kind, `admin`, and one per tenant of `--tenants`, default `demo`; subject permissions;
share domains. nats-server loads that config, and every service gets its own credentials.
`--tls` adds TLS to NATS; `--no-auth` runs open.
Clients take their settings from `auth/env/tenant-<name>.env` (KVF_CLIENT_*), kvctl from
`auth/env/admin.env`; `cluster.json` carries both under `auth`.

Run folder: `cluster.json` (URLs, pids, ready flag), `supervisor.pid`, `logs/<name>.log` (JSON
lines), `nats/` (JetStream store). `down` deletes it.

Data folder (`--data-dir`; `.data` next to the default run folder `.run`, else `<run>/data`,
deleted with that run folder): what must outlive the processes. `secret` (the cluster secret,
0600), `auth/` (the `kvctl auth init` plan: NATS users and passwords, the tenants' share-domain
salts — new salts would turn every stored key into a miss) and `ssd/` (each segment's disk tier
file, `kvf-<segment id>.ssd`, with `--ssd-bytes N`; `make up` sets it). `up` reuses what it
finds there (an auth plan only if it was made for the same tenants and TLS choice; otherwise it
writes a new one and says so) and creates what is missing. `make down` keeps the data folder;
`make clean` removes it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

READY_TIMEOUT_S: Final = 60.0
# Past the services' own stop deadline (`KVF_STOP_DEADLINE_MS`, 25 s: then they exit themselves,
# with a stack dump of what overran): a SIGKILL at 10 s cut stops still in progress (a segment's
# arena left in /dev/shm) and never let the dump happen (review, 2026-12-05).
_PR_SET_PDEATHSIG: Final = 1  # prctl(2)
STOP_TIMEOUT_S: Final = 30.0
RESTARTS_MAX: Final = 5
RESTART_WINDOW_S: Final = 60.0
RESTART_WAIT_S_MIN: Final = 0.2
RESTART_WAIT_S_MAX: Final = 5.0
EXIT_RESTART_ME: Final = 75  # EX_TEMPFAIL: the child asks to be restarted (lease lost, declared down)
POLL_S: Final = 0.2
LOG_FILE_BYTES_MAX: Final = 32 << 20
LOG_FILES_KEPT: Final = 2  # <name>.log.1 .. .2: at most 3 × LOG_FILE_BYTES_MAX per child
LOG_ROTATE_EVERY_S: Final = 1.0
PROBE_CHUNKS: Final = 6
PROBE_TOKENS_PER_CHUNK: Final = 16
PROBE_OBJECT_BYTES: Final = 4096
PROBE_RETRY_S: Final = 0.5
PROBE_CALL_TIMEOUT_S: Final = 5.0


def free_port() -> int:
    """Below the ephemeral range, never twice in this process (`kvfabric.testing.ports`: a port-0
    pick released and bound later could meanwhile be taken by a service's own port-0 bind)."""
    from kvfabric.testing.ports import free_port as pick

    return pick()


def port_free(port: int) -> bool:
    """Whether nats-server could listen on `port` now. With SO_REUSEADDR, as nats-server binds:
    a connection of the last life left in TIME_WAIT does not count, a listener still does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


NATS_MONITOR_PORT_ENV: Final = "KVF_LOCALCLUSTER_NATS_MONITOR_PORT"
NATS_INFO_BYTES_MAX: Final = 64 << 10


def nats_monitor_port(netns_segments: int) -> int:
    """nats-server's HTTP monitoring port, 0 = off (the default). It serves every user, subscription
    and byte counter to anyone who reaches it, without credentials (issue 21 row 11), so it is
    opt-in (`KVF_LOCALCLUSTER_NATS_MONITOR_PORT=<port>` before `up`) and on loopback only: refused
    with netns segments, where nats-server, and its monitor with it, listens on every interface."""
    port = int(os.environ.get(NATS_MONITOR_PORT_ENV) or 0)
    if port and netns_segments:
        raise SystemExit(f"{NATS_MONITOR_PORT_ENV} with --netns-segments: it would listen on every interface")
    return port


def nats_ready(url: str) -> bool:
    """nats-server takes clients with JetStream on: the first line it sends is `INFO {...}` with
    `"jetstream": true` (it enables JetStream before it accepts clients). No monitoring port needed."""
    host, _, port = url.removeprefix("nats://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0) as s:
            line = s.makefile("rb").readline(NATS_INFO_BYTES_MAX)
        info = json.loads(line.removeprefix(b"INFO ")) if line.startswith(b"INFO ") else {}
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("jetstream") is True


def nats_server_binary() -> str:
    local = Path(sys.executable).parent / "nats-server"
    found = str(local) if local.exists() else shutil.which("nats-server")
    if not found:
        raise SystemExit("nats-server not found: run `make setup`")
    return found


def service_argv(module: str, nats_url: str) -> list[str]:
    """`python -m <module>` on the cluster's NATS, any free metrics port, JSON logs."""
    return [sys.executable, "-m", module, "--nats-url", nats_url, "--metrics-port", "0", "--log-json"]


def netns_link(run: Path, i: int) -> dict[str, str]:
    """Names and addresses of segment i's namespace and veth pair (short: interface names ≤ 15)."""
    tag = hashlib.blake2b(str(run).encode(), digest_size=2).hexdigest()
    return {
        "ns": f"kvf-{tag}-{i}",
        "host_if": f"kvh{tag}{i}",
        "ns_if": f"kvn{tag}{i}",
        "host_ip": f"10.231.{i}.1",
        "ns_ip": f"10.231.{i}.2",
    }


def netns_up(link: dict[str, str]) -> None:
    """Create the namespace and its veth pair (root only); idempotent after a crash."""
    netns_down(link)
    ns, host_if, ns_if = link["ns"], link["host_if"], link["ns_if"]
    for cmd in (
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", ns],
        ["ip", "addr", "add", f"{link['host_ip']}/24", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{link['ns_ip']}/24", "dev", ns_if],
        ["ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
    ):
        subprocess.run(cmd, check=True, capture_output=True)


def netns_down(link: dict[str, str]) -> None:
    subprocess.run(["ip", "link", "del", link["host_if"]], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "del", link["ns"]], capture_output=True, check=False)


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    ready_event: str | None  # a JSON log event that says it is ready; None: a readiness URL
    ready_url: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    exits: list[tuple[float, int]] = field(default_factory=list)  # (monotonic s, exit code), recent
    restart_at_s: float | None = None  # exited: started again at this monotonic time
    given_up: bool = False

    def start(self, logs: Path) -> None:
        log = (logs / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # (elsewhere than Linux there is no parent-death signal: a killed supervisor's
            # children run on, and `down` stops them by their recorded pids)
            preexec_fn=_stop_with_parent if sys.platform == "linux" else None,
        )
        log.close()

    def ready(self, logs: Path) -> bool:
        if self.ready_url is not None and self.ready_url.startswith("nats://"):
            return nats_ready(self.ready_url)
        if self.ready_url is not None:
            try:
                with urllib.request.urlopen(self.ready_url, timeout=1.0) as reply:
                    return bool(reply.status == 200)
            except OSError:
                return False
        text = (logs / f"{self.name}.log").read_text(errors="replace")
        return any(f'"event": "{self.ready_event}"' in line for line in text.splitlines())

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)


def always_restarted(name: str) -> bool:
    """nats-server and the directories: the cluster serves nothing without them."""
    return name == "nats" or name == "directory" or name.startswith("directory-")


def restart_wait_s(name: str, exits: list[tuple[float, int]], now_s: float) -> float | None:
    """How long to wait before restarting child `name` that just exited, given its `exits`
    ((monotonic s, exit code), the last one now): `RESTART_WAIT_S_MIN` doubling per exit within
    `RESTART_WINDOW_S`, at most `RESTART_WAIT_S_MAX`. None: give up on it — never on nats or a
    directory; on another child once more than `RESTARTS_MAX` of its exits within the window were
    failures (an exit with `EXIT_RESTART_ME` is a restart it asked for, not a failure)."""
    recent = [(t, code) for t, code in exits if now_s - t < RESTART_WINDOW_S]
    failures = sum(code != EXIT_RESTART_ME for _, code in recent)
    if failures > RESTARTS_MAX and not always_restarted(name):
        return None
    wait_s: float = RESTART_WAIT_S_MIN * 2 ** max(0, len(recent) - 1)
    return min(RESTART_WAIT_S_MAX, wait_s)


def rotate_logs(logs: Path, bytes_max: int = LOG_FILE_BYTES_MAX, kept: int = LOG_FILES_KEPT) -> list[str]:
    """Rotate every `<name>.log` in `logs` larger than `bytes_max`: `.log.<i>` → `.log.<i+1>` (the
    oldest past `kept` dropped), a copy to `.log.1`, then truncate in place (writers append with
    O_APPEND and go on at its start). Returns the names rotated."""
    rotated = []
    for path in sorted(logs.glob("*.log")):
        try:
            if path.stat().st_size <= bytes_max:
                continue
            for i in range(kept, 1, -1):
                older = path.with_name(f"{path.name}.{i - 1}")
                if older.exists():
                    older.replace(path.with_name(f"{path.name}.{i}"))
            shutil.copyfile(path, path.with_name(f"{path.name}.1"))
            with path.open("r+b") as f:
                f.truncate(0)
        except OSError:
            continue  # gone meanwhile (down), or unreadable: next round
        rotated.append(path.name)
    return rotated


def directory_env(env: dict[str, str], name: str, directories: int) -> dict[str, str]:
    """A directory instance's environment: a stable instance id (a restarted instance gets its
    shards back) and, with several instances, the default 16 shards spread by rendezvous hashing
    (each leads its share; a dead one's shards move to the others, and come back by handover);
    a single instance runs one shard. The directory runs at the service's default priority
    (`nice:-10` where permitted, kvfabric.directory.cpu_priority); real time (`rr:1`, which held
    a tenant's flood best, docs/security.md) is opt-in through `KVF_DIRECTORY_CPU_PRIORITY`: on
    a shared host a real-time directory can starve its segments' heartbeats and every other
    process, and this tool also starts the chaos drills' and benches' clusters."""
    out = dict(env, KVF_INSTANCE_ID=name)
    if directories > 1:
        out.setdefault("KVF_DIRECTORY_REBALANCE", "1")
    else:
        # One instance gains nothing from shards and pays a request per shard a prefix spans
        # (a 6-chunk lookup: up to 6), which on this 2-core box slows the whole cluster.
        out.setdefault("KVF_DIRECTORY_SHARDS", "1")
    return out


def plan_children(
    run: Path,
    nats_port: int,
    segments: int,
    segment_bytes: int,
    prefix: str,
    directories: int = 1,
    netns_segments: int = 0,
    data: Path | None = None,
    ssd_bytes: int = 0,
    use_auth: bool = True,
) -> tuple[list[Child], dict[str, Any]]:
    """The children to start. `data`: the data folder (secret, auth, ssd; default: `run`)."""
    data = data or run
    monitor = nats_monitor_port(netns_segments)
    nats_url = f"nats://127.0.0.1:{nats_port}"
    base = dict(os.environ, KVF_CLUSTER_SECRET=(data / "secret").read_text(), KVF_LOG_JSON="true")
    auth = read_auth(data) if use_auth else None

    def as_user(env: dict[str, str], user: str) -> dict[str, str]:
        return dict(env, **auth["users"][user]["env"]) if auth else env

    nats_config = ["-c", auth["conf"]] if auth else []
    children = [
        Child(
            "nats",
            [
                nats_server_binary(),
                "-js",
                "-sd",
                str(run / "nats"),
                "-a",
                "0.0.0.0" if netns_segments else "127.0.0.1",  # netns segments reach it over veth
                "-p",
                str(nats_port),
                *(["-m", str(monitor)] if monitor else []),  # off by default: nats_monitor_port
                *nats_config,
            ],
            dict(os.environ),
            None,
            ready_url=nats_url,
        ),
        Child(
            "directory",
            service_argv("kvfabric.directory", nats_url),
            directory_env(as_user(base, "svc-directory"), "directory", directories),
            "directory_started",
        ),
    ]
    for i in range(2, directories + 1):  # they share the shards; a dead one's move to the others
        children.append(
            Child(
                f"directory-{i}",
                service_argv("kvfabric.directory", nats_url),
                directory_env(as_user(base, "svc-directory"), f"directory-{i}", directories),
                "directory_standby",
            )
        )
    netns: dict[str, dict[str, str]] = {}
    for i in range(1, segments + 1):
        env = dict(
            as_user(base, "svc-segment"),
            KVF_SEGMENT_ID=f"{prefix}-{i}",
            KVF_SEGMENT_BYTES=str(segment_bytes),
            KVF_SEGMENT_ZONE=f"zone-{i}",
            KVF_SEGMENT_RACK=f"rack-{i}",
            KVF_SEGMENT_HOST=f"host-{i}",
        )
        if ssd_bytes:  # its disk tier file outlives the process (data folder)
            env.update(KVF_SEGMENT_SSD_PATH=str(data / "ssd"), KVF_SEGMENT_SSD_BYTES=str(ssd_bytes))
        wrap: list[str] = []
        segment_nats_url = nats_url
        if i <= netns_segments:  # its own network namespace: a host that can be cut off
            link = netns_link(run, i)
            netns[f"segment-{i}"] = link
            wrap = ["ip", "netns", "exec", link["ns"]]
            segment_nats_url = f"nats://{link['host_ip']}:{nats_port}"
            env.update(KVF_SEGMENT_DATA_HOST=link["ns_ip"], KVF_SEGMENT_UCX="0")
        children.append(
            Child(
                f"segment-{i}",
                [*wrap, *service_argv("kvfabric.segment_storage", segment_nats_url)],
                env,
                "segment_started",
            )
        )
    for name, module in (
        ("eviction", "kvfabric.eviction_policy"),
        ("repair", "kvfabric.repair"),
        ("prefetch", "kvfabric.prefetch"),
    ):
        children.append(
            Child(
                name,
                service_argv(module, nats_url),
                as_user(base, f"svc-{name}"),
                f"{name}_started",
            )
        )
    info = {
        "nats_url": nats_url,
        "segment_prefix": prefix,
        "nats_monitor_port": monitor or None,
        "run_dir": str(run),
        "data_dir": str(data),
        "ssd_bytes": ssd_bytes,
        "services": [c.name for c in children],
        "netns": netns,
        "auth": {
            "dir": str(data / "auth"),
            "admin_env": auth["users"]["admin"]["env"],
            "tenants": {t: v["env"] for t, v in auth["tenants"].items()},
        }
        if auth
        else None,
    }
    return children, info


def read_auth(data: Path) -> dict[str, Any] | None:
    """The `kvctl auth init` plan of this data folder; None when there is none."""
    path = data / "auth" / "auth.json"
    if not path.exists():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def write_run_auth(data: Path, tenants: list[str], tls: bool) -> None:
    from kvfabric.ctl.auth import plan_auth, write_auth

    write_auth(data / "auth", plan_auth(tenants), tls=tls)


def default_data_dir(run: Path) -> Path:
    """`.data` beside the default run folder `.run` (kept by `down`); inside any other run folder
    (a test's or a benchmark's: deleted with it, never shared between clusters)."""
    return run.parent / ".data" if run.name == ".run" else run / "data"


def ensure_identity(data: Path, auth: bool, tls: bool, tenants: list[str]) -> str:
    """The cluster's secret and auth plan in `data`: kept when present (and, for the plan, made for
    these tenants and this TLS choice), else written. Returns what happened, for the operator."""
    data.mkdir(parents=True, exist_ok=True)
    said = []
    secret = data / "secret"
    if secret.exists():
        said.append("secret kept")
    else:
        tmp = data / "secret.tmp"
        tmp.write_text(secrets.token_hex(24))
        tmp.chmod(0o600)
        tmp.replace(secret)
        said.append("new secret")
    if auth:
        plan = read_auth(data)
        if plan is not None and sorted(plan["tenants"]) == sorted(tenants) and bool(plan["tls_ca"]) == tls:
            said.append("auth plan kept (tenant salts unchanged)")
        else:
            shutil.rmtree(data / "auth", ignore_errors=True)
            write_run_auth(data, tenants, tls)
            said.append(
                "new auth plan (new tenant salts: keys stored under the old ones miss)"
                if plan is not None
                else "new auth plan"
            )
    return ", ".join(said)


def write_state(
    run: Path, info: dict[str, Any], children: list[Child], ready: bool, not_ready: str | None = None
) -> None:
    state = dict(
        info,
        ready=ready,
        not_ready=not_ready,  # why `up` failed (the readiness probe's last reason)
        supervisor_pid=os.getpid(),
        pids={c.name: (c.proc.pid if c.proc else None) for c in children},
        given_up=[c.name for c in children if c.given_up],
    )
    tmp = run / "cluster.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(run / "cluster.json")


def supervise(
    run: Path,
    nats_port: int,
    segments: int,
    segment_bytes: int,
    prefix: str,
    directories: int = 1,
    netns_segments: int = 0,
    ready_timeout_s: float = READY_TIMEOUT_S,
    data: Path | None = None,
    ssd_bytes: int = 0,
    use_auth: bool = True,
) -> int:
    """The supervisor's main loop (runs detached): start in order, wait ready, probe reads and
    writes, then restart children that exit (`restart_wait_s`) and rotate their logs."""
    logs = run / "logs"
    children, info = plan_children(
        run,
        nats_port,
        segments,
        segment_bytes,
        prefix,
        directories,
        netns_segments,
        data,
        ssd_bytes,
        use_auth,
    )
    for link in info["netns"].values():
        netns_up(link)
    stopping = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    write_state(run, info, children, ready=False)

    def give_up(reason: str) -> int:
        print(json.dumps({"event": "cluster_not_ready", "reason": reason}), flush=True)
        for c in reversed(children):
            c.stop()
        write_state(run, info, children, ready=False, not_ready=reason)
        return 1

    for child in children:  # in order: NATS, directory, segments
        child.start(logs)
        deadline = time.monotonic() + ready_timeout_s
        while not child.ready(logs):
            if stopping or time.monotonic() > deadline or (child.proc and child.proc.poll() is not None):
                return give_up(f"{child.name} did not start (see logs/{child.name}.log)")
            time.sleep(POLL_S)
        write_state(run, info, children, ready=False)
    # Started is not usable: a save and a load must go through (module docstring).
    probed = probe_subprocess(run, segments, ready_timeout_s, lambda: stopping)
    if probed is not None:
        return give_up(probed)
    write_state(run, info, children, ready=True)
    rotated_s = time.monotonic()
    while not stopping:
        now = time.monotonic()
        for child in children:
            if child.given_up or child.proc is None:
                continue
            if child.restart_at_s is not None:
                if now >= child.restart_at_s:
                    child.restart_at_s = None
                    child.start(logs)
                    write_state(run, info, children, ready=not any(c.given_up for c in children))
                continue
            code = child.proc.poll()
            if code is None:
                continue
            child.exits = [e for e in child.exits if now - e[0] < RESTART_WINDOW_S] + [(now, code)]
            wait_s = restart_wait_s(child.name, child.exits, now)
            print(
                json.dumps(
                    {"event": "child_exited", "child": child.name, "exit_code": code, "restart_in_s": wait_s}
                ),
                flush=True,
            )
            if wait_s is None:
                child.given_up = True
            else:
                child.restart_at_s = now + wait_s
            write_state(run, info, children, ready=not any(c.given_up for c in children))
        if now - rotated_s >= LOG_ROTATE_EVERY_S:
            rotated_s = now
            rotate_logs(logs)
        time.sleep(POLL_S)
    for child in reversed(children):
        child.stop()
    for link in info["netns"].values():
        netns_down(link)
    return 0


def probe_subprocess(
    run: Path, segments: int, timeout_s: float, stopping: Callable[[], bool] = lambda: False
) -> str | None:
    """`localcluster.py probe` in its own process (a client, its threads and a bounded life):
    None once the cluster took a save and a load, else the probe's last reason."""
    argv = [sys.executable, __file__, "probe", "--run-dir", str(run), "--segments", str(segments)]
    with subprocess.Popen(
        [*argv, "--ready-timeout-s", str(timeout_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        deadline_s = time.monotonic() + timeout_s + STOP_TIMEOUT_S
        while proc.poll() is None:
            if stopping() or time.monotonic() > deadline_s:
                proc.kill()
                proc.wait()
                return "stopped while probing" if stopping() else "the readiness probe did not end"
            time.sleep(POLL_S)
        assert proc.stdout is not None
        lines = proc.stdout.read().strip().splitlines()
    if proc.returncode == 0:
        return None
    return lines[-1] if lines else f"the readiness probe failed (exit {proc.returncode})"


async def probe_directory(state: dict[str, Any], segments: int) -> str | None:
    """As the admin: every shard led, all `segments` registered and up. None, or what is not."""
    import nats
    import nats.errors

    from kvfabric.cluster.directory_router import DirectoryRouter
    from kvfabric.cluster.natsauth import nats_auth_from_env

    async def quiet(_exc: Exception) -> None:
        return None

    admin = (state.get("auth") or {}).get("admin_env") or {}
    try:
        nc = await nats.connect(
            state["nats_url"],
            allow_reconnect=False,
            connect_timeout=2,
            error_cb=quiet,
            **nats_auth_from_env(admin).connect_options(),
        )
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        return f"NATS not reachable: {type(exc).__name__}"
    try:
        router = DirectoryRouter(nc)
        await router.refresh()
        if not router.shards:
            return "no directory instance answered the shard map"
        if not router.complete:
            return f"shards led {len(router.routes)}/{router.shards}"
        listed = await router.segments(PROBE_CALL_TIMEOUT_S)
        up = [s.segment_id for s in listed.segments if s.up]
        if len(up) < segments:
            return f"segments registered and up {len(up)}/{segments}"
    except Exception as exc:  # any failure is a reason to ask again
        return f"directory: {type(exc).__name__}: {exc}"
    finally:
        await nc.close()
    return None


def probe_save_and_load(state: dict[str, Any]) -> str | None:
    """As the first tenant (the defaults without auth): save `PROBE_CHUNKS` chunks, look them up,
    load them back and compare. None, or the first step that failed."""
    from kvfabric.client import EngineSpec, KvClient, settings_from_env
    from kvfabric.format.key import KVLayout, ModelFingerprint

    tenants = (state.get("auth") or {}).get("tenants") or {}
    settings = settings_from_env(next(iter(tenants.values()), {}), nats_url=state["nats_url"])
    spec = EngineSpec(
        domain=settings.share_domain(),
        model=ModelFingerprint(
            model_id="kvfabric-ready-probe", weights_revision="1", kv_dtype="uint8", attn_config_digest="-"
        ),
        layout=KVLayout(
            tp_size=1,
            tp_rank=0,
            pp_stage=0,
            layer_group=0,
            layer_group_count=1,
            tokens_per_chunk=PROBE_TOKENS_PER_CHUNK,
            tensor_layout="probe-bytes",
        ),
    )
    tokens = [secrets.randbelow(50_000) for _ in range(PROBE_CHUNKS * PROBE_TOKENS_PER_CHUNK)]
    objects = [[secrets.token_bytes(PROBE_OBJECT_BYTES)] for _ in range(PROBE_CHUNKS)]
    client = KvClient(settings, spec)
    try:
        saved = client.save(tokens, objects)
        if saved.chunks_saved + saved.chunks_existing < PROBE_CHUNKS:
            causes = ", ".join(f"{k} {v}" for k, v in sorted(saved.causes.items())) or "none given"
            return f"probe save: {saved.chunks_saved}/{PROBE_CHUNKS} chunks saved ({causes})"
        hit = client.lookup(tokens)
        try:
            if hit.chunks < PROBE_CHUNKS:
                return f"probe lookup: {hit.chunks}/{PROBE_CHUNKS} chunks found ({hit.cause or 'miss'})"
            dests = [[bytearray(PROBE_OBJECT_BYTES)] for _ in range(PROBE_CHUNKS)]
            loaded = client.load(hit, dests)
            if loaded.chunks_loaded < PROBE_CHUNKS or [[bytes(d) for d in c] for c in dests] != objects:
                why = loaded.cause or "bytes differ"
                return f"probe load: {loaded.chunks_loaded}/{PROBE_CHUNKS} chunks ({why})"
        finally:
            client.release(hit)
    finally:
        client.close()
    return None


def probe(run: Path, segments: int, timeout_s: float) -> int:
    """Ask until the cluster takes reads and writes or `timeout_s` passed; prints `ready` or the
    last reason. Exit 0 when ready."""
    import asyncio

    state = read_state(run)
    if state is None:
        print(f"no cluster.json in {run}")
        return 1
    deadline_s = time.monotonic() + timeout_s
    reason = "not probed"
    while time.monotonic() < deadline_s:
        try:
            reason = asyncio.run(probe_directory(state, segments)) or probe_save_and_load(state) or ""
        except Exception as exc:  # a client that could not start, a timeout: ask again
            reason = f"probe: {type(exc).__name__}: {exc}"
        if not reason:
            print("ready", flush=True)
            return 0
        print(reason, flush=True)
        time.sleep(PROBE_RETRY_S)
    return 1


def read_state(run: Path) -> dict[str, Any] | None:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        state: dict[str, Any] = json.loads((run / "cluster.json").read_text())
        return state
    return None


def _stop_with_parent() -> None:
    """In a child, before it runs (Linux): SIGTERM when the supervisor dies, however it dies (a
    SIGKILL, an OOM kill, a crash): its children ran on unsupervised, `status` saying nothing
    runs (review, 2026-12-05). The supervisor starts children from its one thread, whose exit is
    the process's."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the pid was reused by another user's process: ours is gone
        return False
    return True


def up(
    run: Path,
    nats_port: int,
    segments: int,
    segment_bytes: int,
    prefix: str,
    directories: int = 1,
    netns_segments: int = 0,
    auth: bool = True,
    tls: bool = False,
    tenants: tuple[str, ...] = ("demo",),
    ready_timeout_s: float = READY_TIMEOUT_S,
    data: Path | None = None,
    ssd_bytes: int = 0,
) -> int:
    data = data or default_data_dir(run)
    if tls and netns_segments:
        print("--tls with --netns-segments is not supported (the certificate names loopback only)")
        return 2
    state = read_state(run)
    if state and alive(state.get("supervisor_pid")) and state.get("ready"):
        print(f"kvfabric is already up: {state['nats_url']} (run folder {run})")
        return 0
    if state:
        down(run)
    if nats_port and not port_free(nats_port):
        nats_port = free_port()
    run.mkdir(parents=True, exist_ok=True)
    (run / "logs").mkdir(exist_ok=True)
    identity = ensure_identity(data, auth, tls, list(tenants))
    supervisor = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "supervise",
            "--run-dir",
            str(run),
            "--nats-port",
            str(nats_port or free_port()),
            "--segments",
            str(segments),
            "--segment-bytes",
            str(segment_bytes),
            "--segment-prefix",
            prefix,
            "--directories",
            str(directories),
            "--netns-segments",
            str(netns_segments),
            "--ready-timeout-s",
            str(ready_timeout_s),
            "--data-dir",
            str(data),
            "--ssd-bytes",
            str(ssd_bytes),
            *([] if auth else ["--no-auth"]),
        ],
        stdin=subprocess.DEVNULL,
        stdout=(run / "logs" / "supervisor.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (run / "supervisor.pid").write_text(str(supervisor.pid))
    deadline = time.monotonic() + ready_timeout_s * (3 + segments)  # each child, then the probe
    while time.monotonic() < deadline:
        state = read_state(run)
        if state and state.get("ready"):
            print(
                f"kvfabric is up (took a save and a load): {state['nats_url']}; services: "
                f"{', '.join(state['services'])}; logs in {run / 'logs'}"
            )
            disk = f"; disk tier {ssd_bytes} bytes per segment in {data / 'ssd'}" if ssd_bytes else ""
            print(f"data folder {data}: {identity}{disk}")
            if auth:
                print(
                    f"authenticated: kvctl needs `set -a; . {data / 'auth/env/admin.env'}`; tenant clients "
                    f"`. {data / 'auth/env'}/tenant-<name>.env` ({', '.join(tenants)})"
                )
            return 0
        if supervisor.poll() is not None:
            break
        time.sleep(POLL_S)
    reason = (read_state(run) or {}).get("not_ready") or "the supervisor did not report"
    print(f"kvfabric did not come up: {reason}; see {run / 'logs'}", file=sys.stderr)
    down(run, keep_logs=True)
    return 1


def down(run: Path, keep_logs: bool = False) -> int:
    pid_file = run / "supervisor.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    state = read_state(run) or {}
    if alive(pid):
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S * 3
        while alive(pid) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(POLL_S)
    for name, child_pid in (state.get("pids") or {}).items():  # anything the supervisor left behind
        if alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)
            if name.startswith("segment-"):  # a killed segment cannot unlink its arena itself
                prefix = state.get("segment_prefix", "seg")
                # (its arena, slot board and id lock)
                for arena in Path("/dev/shm").glob(f"kvf-{prefix}-{name.removeprefix('segment-')}[-.]*"):
                    with contextlib.suppress(OSError):
                        arena.unlink()
    for link in (state.get("netns") or {}).values():  # a killed supervisor leaves them behind
        netns_down(link)
    if run.exists() and not keep_logs:
        shutil.rmtree(run)
    print("kvfabric is down")
    return 0


def status(run: Path) -> int:
    state = read_state(run)
    if not state or not alive(state.get("supervisor_pid")):
        print("kvfabric is not running")
        return 1
    for name, pid in state["pids"].items():
        mark = "up" if alive(pid) else "DOWN"
        print(f"{name:12} {mark:5} pid {pid}")
    print(f"nats: {state['nats_url']}; ready: {state['ready']}; given up: {state['given_up'] or 'none'}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["up", "down", "status", "supervise", "probe"])
    parser.add_argument("--run-dir", type=Path, default=Path(".run"))
    parser.add_argument("--nats-port", type=int, default=4222, help="0: any free port")
    parser.add_argument("--segments", type=int, default=3)
    parser.add_argument("--segment-bytes", type=int, default=256 << 20)
    parser.add_argument("--segment-prefix", default="seg", help="segment ids are <prefix>-1 .. <prefix>-N")
    parser.add_argument("--directories", type=int, default=1, help="directory instances: 1 leader + standbys")
    parser.add_argument(
        "--netns-segments",
        type=int,
        default=0,
        help="run segments 1..K in their own network namespaces (root)",
    )
    parser.add_argument("--no-auth", action="store_true", help="no NATS users or permissions (open)")
    parser.add_argument("--tls", action="store_true", help="TLS for NATS (a private CA in auth/tls)")
    parser.add_argument("--tenants", default="demo", help="comma-separated tenant names")
    parser.add_argument(
        "--ready-timeout-s",
        type=float,
        default=READY_TIMEOUT_S,
        help="per child to log its start, then for the probe to save and load",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="what outlives the processes (secret, auth, disk tiers): .data beside .run, else <run>/data",
    )
    parser.add_argument("--ssd-bytes", type=int, default=0, help="a disk tier of this many bytes per segment")
    args = parser.parse_args()
    run = args.run_dir.resolve()
    data = args.data_dir.resolve() if args.data_dir else default_data_dir(run)
    if args.command == "up":
        return up(
            run,
            args.nats_port,
            args.segments,
            args.segment_bytes,
            args.segment_prefix,
            args.directories,
            args.netns_segments,
            auth=not args.no_auth,
            tls=args.tls,
            tenants=tuple(t for t in args.tenants.split(",") if t),
            ready_timeout_s=args.ready_timeout_s,
            data=data,
            ssd_bytes=args.ssd_bytes,
        )
    if args.command == "down":
        return down(run)
    if args.command == "status":
        return status(run)
    if args.command == "probe":
        return probe(run, args.segments, args.ready_timeout_s)
    return supervise(
        run,
        args.nats_port,
        args.segments,
        args.segment_bytes,
        args.segment_prefix,
        args.directories,
        args.netns_segments,
        args.ready_timeout_s,
        data,
        args.ssd_bytes,
        use_auth=not args.no_auth,
    )


if __name__ == "__main__":
    sys.exit(main())

"""A local kvfabric cluster on loopback, no docker: `make up` / `make down` (and `status`).

    python tools/localcluster.py up     [--run-dir .run] [--nats-port 4222] [--segments 3]
    python tools/localcluster.py status [--run-dir .run]
    python tools/localcluster.py down   [--run-dir .run]

`up` starts a supervisor in the background and returns once the cluster is ready. The supervisor
owns every child: nats-server (JetStream, store under the run folder), one directory (plus
`--directories - 1` standbys, `directory-<i>`), N
segments in N distinct failure domains (zone-<i>/rack-<i>/host-<i>), and the eviction-policy,
repair and prefetch services. A child that exits is
restarted with a backoff (a segment the directory declared down exits 75 and comes back empty
under a new incarnation); after `RESTARTS_MAX` restarts in `RESTART_WINDOW_S` it stays down and the
supervisor says so. `down` stops the supervisor (SIGTERM: children stopped in reverse order, then
killed if they hang) and deletes the run folder: no process and no run file is left behind.

Authenticated by default (issue "Tenancy and security", docs/security.md): `up` runs
`kvctl auth init` into `auth/` (a NATS user per service kind, `admin`, and one per tenant of
`--tenants`, default `demo`; subject permissions; share domains), nats-server loads that config,
and every service gets its own credentials. `--tls` adds TLS to NATS; `--no-auth` runs open.
Clients take their settings from `auth/env/tenant-<name>.env` (KVF_CLIENT_*), kvctl from
`auth/env/admin.env`; `cluster.json` carries both under `auth`.

Run folder: `cluster.json` (URLs, pids, ready flag), `secret` (the cluster secret, 0600),
`supervisor.pid`, `logs/<name>.log` (JSON lines), `nats/` (JetStream store), `auth/`.
"""

from __future__ import annotations

import argparse
import contextlib
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

READY_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 10.0
RESTARTS_MAX: Final = 5
RESTART_WINDOW_S: Final = 60.0
POLL_S: Final = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


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
    restarts: list[float] = field(default_factory=list)
    given_up: bool = False

    def start(self, logs: Path) -> None:
        log = (logs / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()

    def ready(self, logs: Path) -> bool:
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


def directory_env(env: dict[str, str], name: str, directories: int) -> dict[str, str]:
    """A directory instance's environment: a stable instance id (a restarted instance gets its
    shards back) and, with several instances, the default 16 shards spread by rendezvous hashing
    (each leads its share; a dead one's shards move to the others, and come back by handover);
    a single instance runs one shard."""
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
) -> tuple[list[Child], dict[str, Any]]:
    monitor = free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    base = dict(os.environ, KVF_CLUSTER_SECRET=(run / "secret").read_text(), KVF_LOG_JSON="true")
    auth = read_auth(run)

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
                "-m",
                str(monitor),
                *nats_config,
            ],
            dict(os.environ),
            None,
            ready_url=f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true",
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
        "nats_monitor_port": monitor,
        "run_dir": str(run),
        "services": [c.name for c in children],
        "netns": netns,
        "auth": {
            "dir": str(run / "auth"),
            "admin_env": auth["users"]["admin"]["env"],
            "tenants": {t: v["env"] for t, v in auth["tenants"].items()},
        }
        if auth
        else None,
    }
    return children, info


def read_auth(run: Path) -> dict[str, Any] | None:
    """The `kvctl auth init` plan of this run folder; None when the cluster runs without auth."""
    path = run / "auth" / "auth.json"
    if not path.exists():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def write_run_auth(run: Path, tenants: list[str], tls: bool) -> None:
    from kvfabric.ctl.auth import plan_auth, write_auth

    write_auth(run / "auth", plan_auth(tenants), tls=tls)


def write_state(run: Path, info: dict[str, Any], children: list[Child], ready: bool) -> None:
    state = dict(
        info,
        ready=ready,
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
) -> int:
    """The supervisor's main loop (runs detached): start in order, wait ready, restart on exit."""
    logs = run / "logs"
    children, info = plan_children(
        run, nats_port, segments, segment_bytes, prefix, directories, netns_segments
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
    for child in children:  # in order: NATS, directory, segments
        child.start(logs)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not child.ready(logs):
            if stopping or time.monotonic() > deadline or (child.proc and child.proc.poll() is not None):
                for c in reversed(children):
                    c.stop()
                write_state(run, info, children, ready=False)
                return 1
            time.sleep(POLL_S)
        write_state(run, info, children, ready=False)
    write_state(run, info, children, ready=True)
    while not stopping:
        for child in children:
            if child.given_up or child.proc is None or child.proc.poll() is None:
                continue
            now = time.monotonic()
            child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(child.restarts) > RESTARTS_MAX:
                child.given_up = True
            else:
                time.sleep(min(2.0, 0.2 * 2 ** len(child.restarts)))
                child.start(logs)
            write_state(run, info, children, ready=not any(c.given_up for c in children))
        time.sleep(POLL_S)
    for child in reversed(children):
        child.stop()
    for link in info["netns"].values():
        netns_down(link)
    return 0


def read_state(run: Path) -> dict[str, Any] | None:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        state: dict[str, Any] = json.loads((run / "cluster.json").read_text())
        return state
    return None


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
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
) -> int:
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
    secret = run / "secret"
    secret.write_text(secrets.token_hex(24))
    secret.chmod(0o600)
    shutil.rmtree(run / "auth", ignore_errors=True)
    if auth:
        write_run_auth(run, list(tenants), tls)
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
        ],
        stdin=subprocess.DEVNULL,
        stdout=(run / "logs" / "supervisor.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (run / "supervisor.pid").write_text(str(supervisor.pid))
    deadline = time.monotonic() + READY_TIMEOUT_S * (2 + segments)
    while time.monotonic() < deadline:
        state = read_state(run)
        if state and state.get("ready"):
            print(
                f"kvfabric is up: {state['nats_url']}; services: {', '.join(state['services'])}; "
                f"logs in {run / 'logs'}"
            )
            if auth:
                print(
                    f"authenticated: kvctl needs `set -a; . {run / 'auth/env/admin.env'}`; tenant clients "
                    f"`. {run / 'auth/env'}/tenant-<name>.env` ({', '.join(tenants)})"
                )
            return 0
        if supervisor.poll() is not None:
            break
        time.sleep(POLL_S)
    print(f"kvfabric did not come up; see {run / 'logs'}", file=sys.stderr)
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
    parser.add_argument("command", choices=["up", "down", "status", "supervise"])
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
    args = parser.parse_args()
    run = args.run_dir.resolve()
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
        )
    if args.command == "down":
        return down(run)
    if args.command == "status":
        return status(run)
    return supervise(
        run,
        args.nats_port,
        args.segments,
        args.segment_bytes,
        args.segment_prefix,
        args.directories,
        args.netns_segments,
    )


if __name__ == "__main__":
    sys.exit(main())

"""Issue 21 row 11: anyone who reached the local cluster's NATS monitoring port read, without
credentials, every user (alice's), her subscriptions and byte counters (a hit's reply is ~1 KB
larger than a miss's). The port is now off wherever the project starts nats-server for a cluster:
`tools/localcluster.py` (opt-in on loopback only) and compose (checked by `make compose-check`).

The localcluster test starts the nats-server child exactly as the supervisor plans it and lists
the sockets that process listens on: only the client port.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvfabric.testing.ports import free_port
from tests.unit.tools.toolkit import REPO, load_tool

READY_TIMEOUT_S = 10.0

lc = load_tool("localcluster")


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            raw = bytes.fromhex(addr_hex)
            addr = socket.inet_ntoa(raw[::-1]) if len(raw) == 4 else socket.inet_ntop(socket.AF_INET6, raw)
            out.add((addr, int(port_hex, 16)))
    return out


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "secret").write_text("s" * 32)
    lc.write_run_auth(run, ["alice"], tls=False)
    return run


@contextmanager
def started_nats(module: ModuleType, run: Path, nats_port: int) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The nats-server child as `module`'s supervisor plans and starts it, once it is ready."""
    children, info = module.plan_children(run, nats_port, 1, 64 << 20, "seg")
    nats = children[0]
    assert nats.name == "nats"
    nats.start(run / "logs")
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not nats.ready(run / "logs"):  # the supervisor's own readiness check
            assert nats.proc.poll() is None, (run / "logs" / "nats.log").read_text()
            assert time.monotonic() < deadline, "nats-server not ready"
            time.sleep(0.05)
        yield nats, info
    finally:
        nats.stop()


def test_localcluster_nats_serves_its_client_port_and_nothing_else(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(lc.NATS_MONITOR_PORT_ENV, raising=False)
    nats_port = free_port()
    with started_nats(lc, run, nats_port) as (nats, info):
        assert listening(nats.proc.pid) == {("127.0.0.1", nats_port)}
        assert info["nats_monitor_port"] is None


def test_the_monitor_is_opt_in_and_on_loopback_only(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monitor = free_port()
    monkeypatch.setenv(lc.NATS_MONITOR_PORT_ENV, str(monitor))
    nats_port = free_port()
    with started_nats(lc, run, nats_port) as (nats, info):
        assert listening(nats.proc.pid) == {("127.0.0.1", nats_port), ("127.0.0.1", monitor)}
        assert info["nats_monitor_port"] == monitor
    with pytest.raises(SystemExit, match="every"):  # netns segments: nats listens on every interface
        lc.plan_children(run, free_port(), 1, 64 << 20, "seg", netns_segments=1)


def test_compose_runs_nats_without_a_monitoring_port(tmp_path: Path) -> None:
    check = load_tool("compose_check")
    assert check.check() == []
    compose = tmp_path / "compose"
    shutil.copytree(REPO / "compose", compose)
    for flag in ('"--http_port", "8222"', '"-m", "8222"', '"--https_port", "8222"'):
        target = compose / "docker-compose.yml"
        text = (REPO / "compose" / "docker-compose.yml").read_text()
        old = '"--store_dir", "/data"]'
        assert old in text
        target.write_text(text.replace(old, f'"--store_dir", "/data", {flag}]'))
        problems = check.check(compose)
        assert any("monitoring port must stay off" in p for p in problems), (flag, problems)

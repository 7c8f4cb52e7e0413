"""tools/localcluster.py's supervisor: its restart policy (issue 21: after 6 lease losses in a
60 s flood it gave up on the only directory and the cluster stayed down) and its log rotation
(issue 21 row 13: 188 MB of directory log in 45 min, never rotated)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.unit.tools.toolkit import load_tool

lc = load_tool("localcluster")


def exits_every(interval_s: float, n: int, code: int) -> list[tuple[float, int]]:
    return [(i * interval_s, code) for i in range(n)]


@pytest.mark.parametrize("name", ["directory", "directory-2", "nats"])
@pytest.mark.parametrize("code", [75, 79, -9, 1])
def test_the_directories_and_nats_are_never_given_up_and_wait_a_bounded_time(name: str, code: int) -> None:
    exits: list[tuple[float, int]] = []
    for now_s, c in exits_every(0.5, 200, code):  # a crash loop for 100 s: 2 exits a second
        exits.append((now_s, c))
        wait_s = lc.restart_wait_s(name, exits, now_s)
        assert wait_s is not None
        assert lc.RESTART_WAIT_S_MIN <= wait_s <= lc.RESTART_WAIT_S_MAX


def test_the_wait_doubles_per_recent_exit_and_resets_after_a_quiet_window() -> None:
    waits = [lc.restart_wait_s("directory", exits_every(1.0, n, 75), n - 1.0) for n in range(1, 8)]
    assert waits == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    long_ago = [(0.0, 75)] * 10 + [(lc.RESTART_WINDOW_S + 100, 75)]
    assert lc.restart_wait_s("directory", long_ago, lc.RESTART_WINDOW_S + 100) == 0.2


def test_other_children_are_given_up_after_too_many_failures_but_not_asked_for_restarts() -> None:
    failures = exits_every(1.0, lc.RESTARTS_MAX + 1, 1)
    assert lc.restart_wait_s("segment-1", failures[:-1], failures[-2][0]) is not None
    assert lc.restart_wait_s("segment-1", failures, failures[-1][0]) is None
    # A segment the directory declared down exits 75 and is restarted, however often.
    asked = exits_every(1.0, 50, lc.EXIT_RESTART_ME)
    assert lc.restart_wait_s("segment-1", asked, asked[-1][0]) is not None
    # Failures spread wider than the window are not a crash loop.
    spread = exits_every(lc.RESTART_WINDOW_S / 2, 20, 1)
    assert lc.restart_wait_s("eviction", spread, spread[-1][0]) is not None


def test_logs_are_rotated_in_place_and_writers_go_on_at_the_start(tmp_path: Path) -> None:
    log = tmp_path / "directory.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # as the child holds it
    try:
        for generation in range(4):
            os.write(fd, f"gen-{generation} ".encode() * 100)
            assert lc.rotate_logs(tmp_path, bytes_max=500, kept=2) == ["directory.log"]
            assert log.stat().st_size == 0
        os.write(fd, b"after")
    finally:
        os.close(fd)
    assert log.read_bytes() == b"after"  # no hole: O_APPEND writes at the new end
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["directory.log", "directory.log.1", "directory.log.2"]
    assert (tmp_path / "directory.log.1").read_bytes().startswith(b"gen-3 ")
    assert (tmp_path / "directory.log.2").read_bytes().startswith(b"gen-2 ")
    assert lc.rotate_logs(tmp_path, bytes_max=500, kept=2) == []  # under the bound: left alone


def test_a_recorded_pid_reused_by_another_users_process_is_not_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """`alive` of a pid now another user's (`kill(pid, 0)`: PermissionError) is False: `down`
    crashed part-way on it (review, 2026-12-05)."""
    from kvfabric.runtime.config import STOP_DEADLINE_MS_DEFAULT

    def kill(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", kill)
    assert lc.alive(4242) is False
    assert lc.STOP_TIMEOUT_S * 1000 > STOP_DEADLINE_MS_DEFAULT  # never kills a stop in time


def test_a_child_stops_when_its_supervisor_is_killed(tmp_path: Path) -> None:
    """Children start with a parent-death signal: a SIGKILLed supervisor's services get SIGTERM
    (they ran on unsupervised; review, 2026-12-05)."""
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    assert lc.__file__ is not None
    tool = Path(lc.__file__).resolve()
    parent = textwrap.dedent(
        f"""
        import importlib.util, subprocess, sys, time
        spec = importlib.util.spec_from_file_location("lc", {str(tool)!r})
        lc = importlib.util.module_from_spec(spec)
        sys.modules["lc"] = lc
        spec.loader.exec_module(lc)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 preexec_fn=lc._stop_with_parent)
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child_pid = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def running(pid: int) -> bool:  # a zombie waiting for its new parent to reap it is done
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return state != "Z"

    deadline = time.monotonic() + 10
    while running(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child_pid)

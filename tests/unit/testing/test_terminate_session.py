"""`terminate_session`: every process of the session ends, politely first, by force after the timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from kvfabric.testing.terminate import live_members, terminate_session

# The leader starts a child that outlives it (as vLLM's engine core outlives its runner), then
# waits. A child that exits on SIGTERM writes a marker first: the polite path was taken.
POLITE = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
def bye(*_):
    open(sys.argv[1], "w").write("term")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
time.sleep(60)
''', sys.argv[1]])
time.sleep(60)
"""

# The child ignores SIGTERM: only SIGKILL ends it.
STUBBORN = """
import subprocess, sys, time
ignore_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
subprocess.Popen([sys.executable, "-c", ignore_term])
time.sleep(60)
"""


def _group_alive(pgid: int) -> bool:
    return bool(live_members(pgid))  # zombies are dead: pid 1 reaps orphans at its own pace


def _start(code: str, *args: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True)
    time.sleep(1.0)  # both processes up (and the child's handler installed)
    return proc


def test_a_child_that_outlives_its_leader_gets_sigterm_and_the_session_ends(tmp_path: Path) -> None:
    marker = tmp_path / "child-got-term"
    proc = _start(POLITE, str(marker))
    started = time.monotonic()
    terminate_session(proc, timeout_s=10.0)
    assert not _group_alive(proc.pid)
    assert marker.read_text() == "term"  # it cleaned up: SIGTERM, not SIGKILL
    assert time.monotonic() - started < 5.0


def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout() -> None:
    proc = _start(STUBBORN)
    started = time.monotonic()
    terminate_session(proc, timeout_s=1.0)
    elapsed = time.monotonic() - started
    assert not _group_alive(proc.pid)
    assert 1.0 <= elapsed < 4.0


def test_a_session_already_gone_returns_its_exit_code() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    proc.wait()
    assert terminate_session(proc, timeout_s=1.0) == 3

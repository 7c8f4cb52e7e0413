"""`terminate_session`: every process of the session ends, politely first, by force after the timeout;
`kill_session`: by force at once, and the multiprocessing files its processes mapped are unlinked."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from kvfabric.testing.terminate import kill_session, live_members, session_shm_files, terminate_session

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


# The leader maps a multiprocessing queue's file and a file of another name (a segment's arena,
# say); its child maps a second queue's file. Both then wait to be killed.
MAPS = """
import mmap, os, subprocess, sys, time
def hold(path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    return mmap.mmap(fd, 4096)
held = [hold(sys.argv[1]), hold(sys.argv[2])]
child = subprocess.Popen([sys.executable, "-c", sys.argv[4], sys.argv[3]])
time.sleep(60)
"""
CHILD_MAPS = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
held = mmap.mmap(fd, 4096)
time.sleep(60)
"""


def test_a_killed_session_s_multiprocessing_files_are_unlinked_and_nothing_else() -> None:
    tag = f"kvf-test-{os.getpid()}-{time.monotonic_ns()}"
    queue, child_queue, other = (f"/dev/shm/psm_{tag}", f"/dev/shm/sem.mp-{tag}", f"/dev/shm/{tag}")
    unmapped = f"/dev/shm/psm_{tag}-not-mapped"  # another run's, say: nobody here maps it
    Path(unmapped).write_bytes(b"x")
    proc = subprocess.Popen(
        [sys.executable, "-c", MAPS, queue, other, child_queue, CHILD_MAPS], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30.0  # both processes up and mapped (a busy CI: seconds)
        while not {queue, child_queue} <= session_shm_files(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {queue, child_queue} <= session_shm_files(proc.pid)
        unlinked = kill_session(proc, timeout_s=5.0)
        assert not _group_alive(proc.pid)
        assert sorted(unlinked) == sorted([queue, child_queue])
        assert not os.path.exists(queue) and not os.path.exists(child_queue)
        assert os.path.exists(other) and os.path.exists(unmapped)
    finally:
        kill_session(proc, timeout_s=5.0)  # (a no-op once killed)
        for path in (queue, child_queue, other, unmapped):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

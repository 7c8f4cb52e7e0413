"""Ending a child process: the one way the harness stops nats-server and service processes, and
the engines (vLLM servers) benchmarks and tests start in their own sessions."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

__all__ = [
    "kill_session",
    "live_members",
    "session_shm_files",
    "shm_files_mapped",
    "terminate",
    "terminate_session",
]

SESSION_POLL_S = 0.1
# Python's multiprocessing: SharedMemory's default names, and its named semaphores.
SHM_PREFIXES = ("/dev/shm/psm_", "/dev/shm/sem.mp-")


def terminate(proc: subprocess.Popen[bytes], timeout_s: float, *, kill: bool = False) -> int:
    """SIGTERM (or SIGKILL when `kill`), wait; SIGKILL if it outlives `timeout_s`. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    return proc.returncode


def terminate_session(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM every process of the session `proc` leads (started with `start_new_session=True`),
    wait until none is left alive, SIGKILL what is left after `timeout_s`. Returns `proc`'s exit code.

    Why not SIGKILL at once: vLLM's engine-core and worker processes then leave their shared-memory
    queues (`/dev/shm/psm_*`, up to 250 MB each) and ZMQ socket files (`/tmp/<uuid>`) behind; on
    SIGTERM they unlink them. The whole group is polled (/proc), not only the leader: the engine
    core can outlive the process that started it."""
    pgid = proc.pid
    if proc.returncode is not None and not live_members(pgid):
        return proc.returncode  # reaped and its group gone: its pid may be another's by now
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        if _group_gone(proc, time.monotonic() + timeout_s):
            break
    return proc.wait(timeout=timeout_s)


def kill_session(
    proc: subprocess.Popen[bytes], timeout_s: float, shm_files: set[str] | None = None
) -> list[str]:
    """SIGKILL every process of the session `proc` leads (a crash, for a test or a drill), wait
    until none is left, then unlink the Python multiprocessing files they had mapped
    (`/dev/shm/psm_*` queues, `sem.mp-*` semaphores: killed, vLLM's processes cannot). Returns the
    files unlinked. Only those names, and only files this session's processes mapped: another
    run's on the same host, and a segment's arena a vLLM client maps, are never touched. What no
    process maps any longer at the kill is not found: a killed vLLM server leaves one 32-byte
    `sem.mp-*` (a semaphore of its start-up; its resource tracker would have unlinked it).
    `shm_files`: what `session_shm_files` read before a kill of the caller's own (timed to the
    instant); the group is then killed again (a no-op if it is gone) and those unlinked."""
    mapped = session_shm_files(proc.pid) if shm_files is None else shm_files
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    _group_gone(proc, time.monotonic() + timeout_s)
    proc.wait(timeout=timeout_s)
    unlinked = []
    for path in sorted(mapped):
        try:
            os.unlink(path)
        except FileNotFoundError:  # unlinked before the kill (a queue's creator does at once)
            continue
        unlinked.append(path)
    return unlinked


def session_shm_files(pgid: int) -> set[str]:
    """The multiprocessing files under /dev/shm that the live processes of group `pgid` map."""
    return {path for pid in live_members(pgid) for path in shm_files_mapped(pid)}


def shm_files_mapped(pid: int) -> set[str]:
    """The multiprocessing files under /dev/shm (`SHM_PREFIXES`) that process `pid` maps (from
    /proc/<pid>/maps; empty if it ended). One unlinked already reads `... (deleted)`: left out."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    paths = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith(SHM_PREFIXES) and not path.endswith(" (deleted)"):
            paths.add(path)
    return paths


def _group_gone(proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Poll until no live process of `proc`'s group is left (True) or `deadline` passes (False).
    A zombie is not live: an orphan's is reaped by pid 1 at its own pace (seconds in a sandbox)."""
    while True:
        proc.poll()
        if not live_members(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(SESSION_POLL_S)


def live_members(pgid: int) -> list[int]:
    """The pids in process group `pgid` that are not zombies (from /proc: Linux)."""
    live = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != b"Z":
            live.append(int(entry))
    return live

"""Ending a child process: the one way the harness stops nats-server and service processes."""

from __future__ import annotations

import signal
import subprocess

__all__ = ["terminate"]


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

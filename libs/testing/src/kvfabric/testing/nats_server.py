"""One `nats-server` process with JetStream, for tests and local drills.

States: created → running ⇄ stopped. `start()` picks free ports on first use and keeps them, so
`restart()` brings the server back on the same client and monitoring ports with the same store
dir: clients reconnect to the same URL and JetStream data (streams, KV buckets) survives.

Owns: the process, its log file (`<store_dir>/nats-server.log`, appended across restarts).
The store dir belongs to the caller (a pytest `tmp_path`), which removes it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Final

from kvfabric.testing.ports import free_ports
from kvfabric.testing.terminate import terminate

__all__ = ["NatsServer", "NatsServerError", "find_nats_server"]

READY_TIMEOUT_S_DEFAULT: Final = 10.0
STOP_TIMEOUT_S_DEFAULT: Final = 10.0
_READY_POLL_S: Final = 0.02
_HEALTHZ_REQUEST_TIMEOUT_S: Final = 0.5
_LOG_TAIL_LINES: Final = 20


class NatsServerError(RuntimeError):
    """The server did not start, did not become ready in time, or could not be found."""


def find_nats_server() -> Path:
    """The `nats-server` binary: next to `sys.executable` (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    on_path = shutil.which("nats-server")
    if on_path is None:
        raise NatsServerError(f"nats-server not found next to {sys.executable} nor on PATH")
    return Path(on_path)


class NatsServer:
    """A nats-server with JetStream on free ports. Use as a context manager or call start/stop."""

    def __init__(
        self,
        store_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        monitor_port: int | None = None,
        binary: Path | None = None,
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = READY_TIMEOUT_S_DEFAULT,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.binary = binary if binary is not None else find_nats_server()
        self.extra_args = tuple(extra_args)
        self.ready_timeout_s = ready_timeout_s
        # Chosen once and kept across restarts.
        picked = free_ports(2, host)  # distinct: one port for both and the server cannot start
        self.port = port if port is not None else next(p for p in picked if p != monitor_port)
        self.monitor_port = (
            monitor_port if monitor_port is not None else next(p for p in picked if p != self.port)
        )
        self.log_path = self.store_dir / "nats-server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self.starts = 0

    # ---- addresses -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Client URL, e.g. `nats://127.0.0.1:40123`."""
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        """HTTP monitoring base URL (`/healthz`, `/varz`, `/jsz`)."""
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ---- lifecycle -------------------------------------------------------------------------

    def command(self) -> list[str]:
        return [
            str(self.binary),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-m",
            str(self.monitor_port),
            "-js",
            "-sd",
            str(self.store_dir),
            *self.extra_args,
        ]

    def start(self) -> NatsServer:
        """Start the process and wait until JetStream is ready. Raises `NatsServerError`."""
        if self.running:
            raise NatsServerError(f"nats-server already running (pid {self.pid})")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._close_log()
        self._log_file = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        self.starts += 1
        try:
            self.wait_ready(self.ready_timeout_s)
        except BaseException:
            self.kill()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Poll `/healthz?js-enabled-only=true` until 200, the process exits, or `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        healthz = f"{self.monitor_url}/healthz?js-enabled-only=true"
        last_error = "no attempt"
        while True:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise NatsServerError(
                    f"nats-server exited with code {code} before ready; log tail:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(healthz, timeout=_HEALTHZ_REQUEST_TIMEOUT_S) as response:
                    if response.status == 200:
                        return
                    last_error = f"HTTP {response.status}"
            except (urllib.error.URLError, OSError) as exc:
                last_error = repr(exc)
            if time.monotonic() >= deadline:
                raise NatsServerError(
                    f"nats-server not ready after {timeout_s:.1f} s at {healthz} ({last_error}); "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(_READY_POLL_S)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S_DEFAULT) -> int | None:
        """SIGTERM, wait; SIGKILL if it outlives `timeout_s`. Returns the exit code (None: never started)."""
        proc = self._proc
        if proc is None:
            return None
        terminate(proc, timeout_s)
        self._close_log()
        return proc.returncode

    def kill(self, timeout_s: float = STOP_TIMEOUT_S_DEFAULT) -> int | None:
        """SIGKILL and wait: a crash, no clean shutdown. Returns the exit code (None if not started)."""
        proc = self._proc
        if proc is None:
            return None
        terminate(proc, timeout_s, kill=True)
        self._close_log()
        return proc.returncode

    def restart(self, *, kill: bool = False) -> NatsServer:
        """Stop (or kill) and start again on the same ports with the same store dir."""
        if kill:
            self.kill()
        else:
            self.stop()
        return self.start()

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the server's combined stdout/stderr."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<no log: {exc!r}>"
        return "\n".join(text.splitlines()[-lines:])

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"NatsServer({self.url}, monitor={self.monitor_url}, {state}, store_dir={self.store_dir})"

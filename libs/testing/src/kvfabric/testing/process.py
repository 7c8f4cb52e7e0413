"""A service started as a subprocess, its JSON log lines parsed as they arrive.

Services log one JSON object per line on stderr when stderr is not a TTY (see
`kvfabric.runtime.logs`), so a test waits for an event (`service_started`) and reads fields off
it (`metrics_port`, `instance_id`) instead of sleeping or scraping text.

Owns: the process and one daemon reader thread. Output is kept in memory, bounded to
`OUTPUT_LINES_MAX` lines (oldest dropped).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Final

from kvfabric.testing.terminate import terminate

__all__ = ["ServiceProcess", "ServiceProcessError"]

OUTPUT_LINES_MAX: Final = 10_000
STOP_TIMEOUT_S_DEFAULT: Final = 10.0
_TAIL_LINES: Final = 30


class ServiceProcessError(RuntimeError):
    """The process exited early, or an awaited event did not come in time."""


class ServiceProcess:
    """`ServiceProcess.python_module("kvfabric.runtime.echo_service", "--nats-url", url)`."""

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._cond = threading.Condition()
        self._lines: deque[str] = deque(maxlen=OUTPUT_LINES_MAX)
        self._events: deque[dict[str, Any]] = deque(maxlen=OUTPUT_LINES_MAX)
        self._eof = False

    @classmethod
    def python_module(cls, module: str, *args: str, env: Mapping[str, str] | None = None) -> ServiceProcess:
        """`sys.executable -m <module> <args...>`."""
        return cls([sys.executable, "-m", module, *args], env=env)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> ServiceProcess:
        if self._proc is not None:
            raise ServiceProcessError(f"already started: {self.argv}")
        self._proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        self._reader = threading.Thread(target=self._read, name=f"output-{self._proc.pid}", daemon=True)
        self._reader.start()
        return self

    @property
    def pid(self) -> int:
        return self._require_proc().pid

    @property
    def returncode(self) -> int | None:
        return self._require_proc().poll()

    def send_signal(self, sig: signal.Signals) -> None:
        proc = self._require_proc()
        if proc.poll() is None:
            proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        """Wait for exit; raises `ServiceProcessError` (with the output tail) on timeout."""
        proc = self._require_proc()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise ServiceProcessError(
                f"{self.argv} still running after {timeout_s} s; output tail:\n{self.output_tail()}"
            ) from exc
        self._join_reader(timeout_s)
        return code

    async def wait_async(self, timeout_s: float) -> int:
        return await asyncio.to_thread(self.wait, timeout_s)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S_DEFAULT) -> int | None:
        """SIGTERM, wait; SIGKILL when it outlives `timeout_s`. Returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        terminate(proc, timeout_s)
        self._join_reader(timeout_s)
        return proc.returncode

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- output ----------------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        """Every JSON log line seen so far, in order."""
        with self._cond:
            return list(self._events)

    def output_tail(self, lines: int = _TAIL_LINES) -> str:
        with self._cond:
            return "\n".join(list(self._lines)[-lines:])

    def wait_for_event(self, event: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """The first JSON log line with `event` (and every `fields` equal); waits up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for record in self._events:
                    if record.get("event") == event and all(record.get(k) == v for k, v in fields.items()):
                        return record
                if self._eof:
                    code = self._proc.poll() if self._proc is not None else None
                    raise ServiceProcessError(
                        f"{self.argv} ended output (exit code {code}) without event {event!r}; "
                        f"output tail:\n{self._tail_locked()}"
                    )
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise ServiceProcessError(
                        f"no event {event!r} {fields} within {timeout_s} s from {self.argv}; "
                        f"output tail:\n{self._tail_locked()}"
                    )
                self._cond.wait(remaining_s)

    async def wait_for_event_async(self, event: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        return await asyncio.to_thread(self.wait_for_event, event, timeout_s, **fields)

    # ---- internals -------------------------------------------------------------------------

    def _require_proc(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise ServiceProcessError(f"not started: {self.argv}")
        return self._proc

    def _tail_locked(self) -> str:
        return "\n".join(list(self._lines)[-_TAIL_LINES:])

    def _join_reader(self, timeout_s: float) -> None:
        if self._reader is not None:
            self._reader.join(timeout_s)

    def _read(self) -> None:
        proc = self._require_proc()
        stream = proc.stdout
        if stream is None:  # pragma: no cover - stdout is always a pipe here
            return
        try:
            for raw in stream:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                record = _parse_json_object(line)
                with self._cond:
                    self._lines.append(line)
                    if record is not None:
                        self._events.append(record)
                    self._cond.notify_all()
        finally:
            stream.close()
            with self._cond:
                self._eof = True
                self._cond.notify_all()


def _parse_json_object(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

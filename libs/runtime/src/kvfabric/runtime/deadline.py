"""Bounded stops: tasks cancelled with a deadline, and a process that cannot stop in time exits.

docs/design.md, "Liveness is an invariant": every task is cancellable and awaited with a deadline; a
process that cannot stop in time exits, and its supervisor restarts it. An instance that hangs
in its stop path is alive but serves nothing, and no supervisor restarts a live process
(issue 21: a directory whose lease lapsed waited 4.5 min on a cancelled task).

- `cancel_and_wait(tasks, timeout_s)`: cancel, wait, and cancel again what still runs, until
  `timeout_s`; returns the tasks still running. Cancelling once is not enough: a cancellation
  can be swallowed. Python 3.11's `asyncio.wait_for` returns the awaited result instead of
  raising when the cancel and that result land in the same loop iteration (a NATS request whose
  reply arrived: likely when the loop is flooded), and the cancelled task runs on. The second
  cancel comes `RECANCEL_FIRST_S` later (a task still cleaning up gets that long), then doubling.
- `stop_tasks(tasks, log)`: a service shell's stop of its tasks: `cancel_and_wait` for
  `TASKS_STOP_S` (5 s), then a `stop_tasks_left` warning naming those still running (left to
  the watchdog). One cancel then a bare `gather` waited for good on a swallowed cancel.
- `StopWatchdog`: a daemon thread that runs even while the event loop is wedged. Armed when a
  stop is requested (`ServiceRuntime.request_stop`); when its deadline passes it calls
  `exit_now(EXIT_STOP_OVERRUN, "stop_overran")`. It is never disarmed by a service's own stop:
  it also covers what runs after (closing NATS, `asyncio.run` cancelling leftover tasks and
  joining the default executor, which wait without a bound).
- `exit_now(code, event)`: one JSON log line (written with `os.write`, not through structlog,
  whose lock the wedged thread may hold), every thread's stack (faulthandler), `os._exit(code)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

__all__ = [
    "EXIT_STOP_OVERRUN",
    "RECANCEL_FIRST_S",
    "TASKS_STOP_S",
    "StopWatchdog",
    "cancel_and_wait",
    "exit_now",
    "stop_tasks",
]

# Not a sysexits code: a stop that overran its deadline (or a second stop signal), os._exit.
EXIT_STOP_OVERRUN: Final = 79
RECANCEL_FIRST_S: Final = 0.05  # then doubling: 0.05, 0.1, 0.2 ... s between cancels
WATCHDOG_POLL_S: Final = 0.1  # how late past its deadline the watchdog may fire
# How long a shell's `stop` waits for its cancelled tasks (`stop_tasks`); the rest is the stop
# watchdog's.
TASKS_STOP_S: Final = 5.0


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout_s: float) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` and wait for them, cancelling again what still runs, for at most
    `timeout_s`. Returns the tasks still running then (empty when all ended). Never raises for
    the tasks' outcomes; a cancellation of the caller propagates."""
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + max(0.0, timeout_s)
    pending = {task for task in tasks if not task.done()}
    wait_s = RECANCEL_FIRST_S
    while pending:
        for task in pending:
            task.cancel()
        left_s = deadline_s - loop.time()
        if left_s <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(wait_s, left_s))
        wait_s *= 2
    return pending


async def stop_tasks(
    tasks: Iterable[asyncio.Task[Any]], log: Any, timeout_s: float = TASKS_STOP_S
) -> set[asyncio.Task[Any]]:
    """A shell's `stop` of its tasks: `cancel_and_wait` for `timeout_s`, and a `stop_tasks_left`
    warning (`log`: a structlog logger) naming those still running, left to the stop watchdog.
    One cancel then a bare `gather` waited for good on a task whose cancel was swallowed (the
    eviction policy's adopter waits on an event with `wait_for`; review, 2026-12-07)."""
    stuck = await cancel_and_wait(tasks, timeout_s)
    if stuck:
        log.warning("stop_tasks_left", tasks=sorted(task.get_name() for task in stuck))
    return stuck


def exit_now(
    code: int,
    event: str,
    *,
    identity: Mapping[str, object] | None = None,
    exit: Callable[[int], object] = os._exit,
    **fields: object,
) -> None:
    """Log `event` (critical) with every thread's stack and end the process with `code` at once:
    no cleanup runs (a supervisor restarts the process; a killed segment's files are removed by
    its next start). `exit` is for tests."""
    record: dict[str, object] = {
        "event": event,
        "level": "critical",
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z"),
        **(identity or {}),
        "exit_code": code,
        **fields,
    }
    with contextlib.suppress(OSError, ValueError):  # no stderr left: exit anyway
        os.write(2, json.dumps(record, default=str).encode() + b"\n")
        if sys.stderr is not None:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    exit(code)


class StopWatchdog:
    """Ends the process when a requested stop overruns its deadline (module docstring).

    `arm` and `disarm` only assign attributes (no lock): safe from a signal handler that
    interrupted any code of the main thread."""

    def __init__(
        self,
        *,
        identity: Mapping[str, object] | None = None,
        exit: Callable[[int], object] = os._exit,
        poll_s: float = WATCHDOG_POLL_S,
    ) -> None:
        self.identity = dict(identity or {})
        self._exit = exit
        self.poll_s = poll_s
        self._deadline_s: float | None = None  # time.monotonic()
        self._timeout_s = 0.0
        self._reason = ""
        self._closed = False
        self._thread: threading.Thread | None = None
        self.fired = False

    @property
    def armed(self) -> bool:
        return self._deadline_s is not None

    def start(self) -> None:
        """Start the thread (once). Call it from normal code, before any signal can arm it."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvf-stop-watchdog", daemon=True)
        self._thread.start()

    def arm(self, timeout_s: float, reason: str) -> None:
        """Exit unless disarmed within `timeout_s`; an earlier deadline already set is kept."""
        deadline_s = time.monotonic() + timeout_s
        current = self._deadline_s
        if current is not None and current <= deadline_s:
            return
        self._timeout_s, self._reason = timeout_s, reason
        self._deadline_s = deadline_s

    def disarm(self) -> None:
        self._deadline_s = None

    def close(self) -> None:
        """Disarm and end the thread (an in-process runtime that stopped: tests, `run`)."""
        self._deadline_s = None
        self._closed = True

    def _run(self) -> None:
        while not self._closed:
            time.sleep(self.poll_s)
            deadline_s = self._deadline_s
            if deadline_s is None or self._closed or time.monotonic() < deadline_s:
                continue
            self.fired = True
            exit_now(
                EXIT_STOP_OVERRUN,
                "stop_overran",
                identity=self.identity,
                exit=self._exit,
                reason=self._reason,
                stop_deadline_ms=round(self._timeout_s * 1000),
            )
            return

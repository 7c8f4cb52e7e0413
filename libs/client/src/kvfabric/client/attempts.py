"""A replica read's attempt budget, and the watchdog that holds reads to it.

Per-attempt budget: a load's reads carry its deadline (`deadline_s`, monotonic). A replica read
that is not the last one to try gets `attempt_budget_s` of what is left (by default half, at least
`attempt_min_s`), then the next replica is tried within the same load; the last one gets all that
is left. Only an attempt with a budget shorter than what is left is watched: `AttemptWatchdog`
(one thread per pool, no timer per read) shuts its socket down when the budget runs out, which
wakes the blocked read at once; the read then fails with `TimeoutError`, its connection is closed
(never pooled half-read) and its semaphore slot given back. A read that answers in time costs an
entry in a dict, nothing more.
"""

from __future__ import annotations

import itertools
import math
import socket
import threading
import time
from typing import Final

from kvfabric.dataplane.tcp import shutdown_fd

__all__ = ["ATTEMPT_MIN_S_DEFAULT", "ATTEMPT_SHARE_DEFAULT", "AttemptWatchdog", "attempt_budget_s"]

ATTEMPT_SHARE_DEFAULT: Final = 0.5  # of the load's time left, for a replica that is not the last
ATTEMPT_MIN_S_DEFAULT: Final = 0.1  # ... but at least this long (seconds)


def attempt_budget_s(remaining_s: float, last: bool, share: float, min_s: float) -> float:
    """Seconds one replica read may take when `remaining_s` are left of its load: the last replica
    tried gets all of it; an earlier one `share` of it, at least `min_s`, never more than is left."""
    if last or share >= 1.0:
        return remaining_s
    return min(remaining_s, max(min_s, remaining_s * share))


class AttemptWatchdog:
    """Cuts replica reads past their attempt deadline (monotonic seconds) by shutting their socket
    down. One lazily started thread sleeps until the earliest armed deadline; `arm` wakes it only
    when the new deadline is earlier than that (rare: later attempts have later deadlines).

    Ownership: `arm` → the watchdog may shut the socket's descriptor down until `disarm` returns;
    the caller must `disarm` before it closes the socket (the descriptor could be reused)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: dict[int, tuple[float, int]] = {}  # id -> (deadline, fd)
        self._cut: set[int] = set()
        self._ids = itertools.count(1)
        self._wake_s = math.inf  # when the thread wakes next by itself
        self._thread: threading.Thread | None = None
        self._closed = False
        self.cuts = 0

    def arm(self, sock: socket.socket, deadline_s: float) -> int:
        with self._cond:
            armed = next(self._ids)
            self._armed[armed] = (deadline_s, sock.fileno())
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="kvf-attempt-watchdog", daemon=True)
                self._thread.start()
            elif deadline_s < self._wake_s:
                self._cond.notify()
        return armed

    def disarm(self, armed: int) -> bool:
        """Stop watching; True when the watchdog already cut this attempt."""
        with self._cond:
            if armed in self._cut:
                self._cut.discard(armed)
                return True
            self._armed.pop(armed, None)
            return False

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for armed, (deadline_s, fd) in list(self._armed.items()):
                    if deadline_s <= now:
                        del self._armed[armed]
                        shutdown_fd(fd)  # under the lock: its owner has not disarmed, fd still its
                        self._cut.add(armed)
                        self.cuts += 1
                self._wake_s = min((d for d, _ in self._armed.values()), default=math.inf)
                self._cond.wait(None if self._wake_s == math.inf else self._wake_s - now)

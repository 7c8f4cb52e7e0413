"""Blocking calls that may write or sync the disk tier's files from a worker thread (a free
record's retry, a suspect's check), counted so that the segment's stop closes those files only
once none runs (review, stop 65: cancelling `asyncio.to_thread` does not stop its thread, and one
still running wrote a free record through a descriptor number the close had freed and another
file had taken).

States: OPEN (calls start, counted while they run) --`wait_idle`--> CLOSING (a call that has not
started refuses with `DiskClosing`, touching nothing; `wait_idle` returns True once none runs,
False at its timeout: the caller then leaves the files open for the process's exit to close).

Invariant: `running` is the calls between their start and their end.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["DiskCalls", "DiskClosing"]

T = TypeVar("T")


class DiskClosing(RuntimeError):
    """The segment is stopping: the disk tier's files may be closed; the call did not run."""


class DiskCalls:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.running = 0
        self.closing = False

    async def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on a worker thread, counted; `DiskClosing` once the stop began."""
        return await asyncio.to_thread(self._counted, fn)

    def _counted(self, fn: Callable[[], T]) -> T:
        with self._changed:
            if self.closing:
                raise DiskClosing("the disk tier is closing")
            self.running += 1
        try:
            return fn()
        finally:
            with self._changed:
                self.running -= 1
                self._changed.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """No call starts from now on; blocks until none runs (at most `timeout_s`). Whether
        none runs."""
        with self._changed:
            self.closing = True
            return self._changed.wait_for(lambda: self.running == 0, timeout_s)

"""Periodic work in a shell: one loop for every service's "do this every N ms".

`every(interval_s, step, failed=...)` awaits `step()` now, then again `interval_s` after each
run returned, until its task is cancelled (the shell's `stop`). Runs never overlap and a slow
run delays the next one rather than piling up (an interval of 0 only yields to the loop). An
expected failure of one run (a `KvfError`: the directory is down, a request timed out) goes to
`failed` (the shell logs it) and the loop goes on, so an outage delays a scan and never ends
the loop; without `failed`, and for any other exception, the loop ends with it (the task's
exception, which the shell's stop retrieves). Used by `CoreDriver`'s ticker, the prefetch and
repair scans, the eviction policy's segment refresh and admission-filter publication, and the
router's health checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import NoReturn

from kvfabric.format.errors import KvfError

__all__ = ["every"]


async def every(
    interval_s: float,
    step: Callable[[], Awaitable[object]],
    failed: Callable[[KvfError], None] | None = None,
) -> NoReturn:
    """Run `step` now and `interval_s` after each run returned, until cancelled (module docstring)."""
    while True:
        try:
            await step()
        except KvfError as exc:
            if failed is None:
                raise
            failed(exc)
        await asyncio.sleep(interval_s)

"""Periodic work in a shell: one loop for every service's "do this every N ms".

`every(interval_s, step, failed=...)` awaits `step()` now (with `delay_first=True`: `interval_s`
from now), then again `interval_s` after each run returned, until its task is cancelled (the shell's
`stop`). Runs never overlap and a slow run delays the next one rather than piling up (an interval of
0 only yields to the loop). An expected failure of one run (a `KvfError`: the directory is down, a
request timed out) goes to `failed` (the shell logs it) and the loop goes on, so an outage delays a
scan and never ends the loop; without `failed`, and for any other exception, the loop ends with it
(the task's exception, which the shell's stop retrieves). Used by `CoreDriver`'s ticker, the
prefetch and repair scans, the eviction policy's segment refresh and admission-filter publication,
the router's health checks, and, delayed first, the directory shell's core tick and the segment's
scrubber and SSD unlink retries.
Not by the segment's heartbeats: they keep a fixed cadence (`due += interval`, a round never delays
the next), re-read the interval each round and end on `segment_declared_down` (see
`ShellDirectory._heartbeats`).
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
    *,
    delay_first: bool = False,
) -> NoReturn:
    """Run `step` now (`delay_first`: `interval_s` from now) and `interval_s` after each run
    returned, until cancelled (module docstring)."""
    if delay_first:
        await asyncio.sleep(interval_s)
    while True:
        try:
            await step()
        except KvfError as exc:
            if failed is None:
                raise
            failed(exc)
        await asyncio.sleep(interval_s)

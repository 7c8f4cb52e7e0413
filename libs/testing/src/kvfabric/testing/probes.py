"""Probes a test points at a running service: ADR-32 control requests, `/metrics` scrapes, and a
bounded poll for state that cannot be awaited."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import urllib.request
from collections.abc import Callable
from typing import Any, Final

from nats.aio.client import Client as NatsClient

__all__ = [
    "metric_value",
    "micro_control",
    "scrape_metrics",
    "scrape_metrics_async",
    "scrape_metrics_once_served",
    "wait_until",
]

CONTROL_TIMEOUT_S_DEFAULT: Final = 2.0
SCRAPE_TIMEOUT_S_DEFAULT: Final = 2.0


async def micro_control(
    nc: NatsClient,
    verb: str,
    name: str | None = None,
    instance: str | None = None,
    *,
    timeout_s: float = CONTROL_TIMEOUT_S_DEFAULT,
) -> dict[str, Any]:
    """One `$SRV.<verb>[.<name>[.<id>]]` request (verb: PING, INFO, STATS), JSON-decoded (first reply)."""
    subject = "$SRV." + ".".join(part for part in (verb, name, instance) if part is not None)
    reply = await nc.request(subject, b"", timeout=timeout_s)
    value = json.loads(reply.data)
    if not isinstance(value, dict):
        raise ValueError(f"{subject} replied with {type(value).__name__}, want an object")
    return value


def scrape_metrics(port: int, host: str = "127.0.0.1", timeout_s: float = SCRAPE_TIMEOUT_S_DEFAULT) -> str:
    """GET `http://<host>:<port>/metrics` (blocking)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as response:
        body: bytes = response.read()
    return body.decode()


def scrape_metrics_once_served(port: int, within_s: float = 5.0, host: str = "127.0.0.1") -> str:
    """`scrape_metrics`, asked again while the server refuses or drops it (its connection slots
    still taken: closed connections free theirs as their handlers end), for about `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return scrape_metrics(port, host, timeout_s=min(SCRAPE_TIMEOUT_S_DEFAULT, within_s))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


async def scrape_metrics_async(
    port: int, host: str = "127.0.0.1", timeout_s: float = SCRAPE_TIMEOUT_S_DEFAULT
) -> str:
    return await asyncio.wait_for(asyncio.to_thread(scrape_metrics, port, host, timeout_s), timeout_s * 2)


def metric_value(exposition: str, name: str, /, **labels: str) -> float | None:
    """The value of sample `name{labels}` in a text exposition (labels matched exactly), or None."""
    for line in exposition.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
        if found == labels:
            return float(match.group(3))
    return None


async def wait_until(
    condition: Callable[[], bool], timeout_s: float, *, poll_s: float = 0.01, what: str = "condition"
) -> None:
    """Poll `condition` every `poll_s` until it holds; `TimeoutError` after about `timeout_s`.

    For state a test cannot await directly (a counter in another object, a connection flag).
    The loop is bounded by a poll count, not only by the clock.
    """
    polls_max = max(1, math.ceil(timeout_s / poll_s))
    for _ in range(polls_max):
        if condition():
            return
        await asyncio.sleep(poll_s)
    if not condition():
        raise TimeoutError(f"{what} did not hold within {timeout_s} s")

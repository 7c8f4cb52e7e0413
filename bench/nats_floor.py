"""The floor under every directory round trip: a NATS request/reply between two Python processes.

A kvfabric directory call (lookup, put_begin, put_commit) is a nats-py request from the client's
event loop, through nats-server, to a `nats.micro` endpoint on the directory's event loop, and
back. This measures that path with nothing behind it: an echo endpoint (`nats.micro`, as the
directory's) in a process of its own, on a nats-server of its own, answering a request of the
size of a lookup of 8 chunks (~1 KB) with a reply of the same size. Two rows:

- `in the client loop`: the request awaited on the client's loop (what `bench.client_floor`'s
  "directory put_begin, in the client loop" row adds the directory's own work to);
- `from a calling thread`: what an engine pays — submitted to that loop from another thread with
  `run_coroutine_threadsafe` and waited for (`KvClient`'s engine-thread calls do this).

Run: `.venv/bin/python -m bench.nats_floor [--calls 2000]`; `bench.client_floor` runs it too, so
its rows sit next to the directory's in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Final

import nats
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import ServiceConfig

from kvfabric.testing.nats_server import NatsServer

SUBJECT: Final = "floor.echo"
PAYLOAD_BYTES: Final = 1024
WARMUP_CALLS: Final = 200


async def _serve(url: str) -> None:
    """The echo endpoint, until stdin closes (the parent's exit)."""
    nc = await nats.connect(url)
    service = await add_service(nc, ServiceConfig(name="floor", version="0.0.1"))

    async def echo(msg: Request) -> None:
        await msg.respond(msg.data)

    await service.add_endpoint(name="echo", subject=SUBJECT, handler=echo)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await service.stop()
    await nc.close()


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": ordered[len(ordered) // 2] * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
        "mean_ms": sum(ordered) / len(ordered) * 1e3,
        "calls": len(ordered),
    }


def measure(calls: int) -> dict[str, dict[str, float]]:
    """Both rows, against an echo process and a nats-server this call starts and stops."""
    with tempfile.TemporaryDirectory(prefix="kvf-nats-floor-") as tmp, NatsServer(Path(tmp)) as server:
        echo = subprocess.Popen(
            [sys.executable, "-m", "bench.nats_floor", "--serve", server.url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert echo.stdout is not None
            if echo.stdout.readline().strip() != "ready":
                raise RuntimeError("the echo process did not start")
            return _measure_against(server.url, calls)
        finally:
            assert echo.stdin is not None
            echo.stdin.close()
            try:
                echo.wait(timeout=10)
            except subprocess.TimeoutExpired:
                echo.kill()
                echo.wait()


def _measure_against(url: str, calls: int) -> dict[str, dict[str, float]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="floor-loop", daemon=True)
    thread.start()
    payload = b"x" * PAYLOAD_BYTES
    try:
        nc = asyncio.run_coroutine_threadsafe(nats.connect(url), loop).result(10)

        async def in_loop(n: int) -> list[float]:
            out = []
            for _ in range(n):
                started = time.perf_counter()
                await nc.request(SUBJECT, payload, timeout=5)
                out.append(time.perf_counter() - started)
            return out

        asyncio.run_coroutine_threadsafe(in_loop(WARMUP_CALLS), loop).result(60)
        looped = asyncio.run_coroutine_threadsafe(in_loop(calls), loop).result(600)
        threaded = []
        for _ in range(WARMUP_CALLS + calls):
            started = time.perf_counter()
            asyncio.run_coroutine_threadsafe(nc.request(SUBJECT, payload, timeout=5), loop).result(5)
            threaded.append(time.perf_counter() - started)
        asyncio.run_coroutine_threadsafe(nc.close(), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    return {
        "NATS request/reply floor (nats.micro echo, own process), in the client loop": _percentiles(looped),
        "NATS request/reply floor, from a calling thread": _percentiles(threaded[WARMUP_CALLS:]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)  # the echo process
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    print(json.dumps(measure(args.calls), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

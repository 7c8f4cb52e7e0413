"""How long `AsyncKvClient.close()` takes with 1,000 read leases held (issue 20).

A local nats-server, one directory and one segment (no auth, no TLS); a client saves one chunk,
looks it up 1,000 times (one lease each, 8 lookups at a time), then closes; five rounds.

.venv/bin/python tools/release_close_time.py
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from kvfabric.client import AsyncKvClient, ClientSettings
from kvfabric.testing import NatsServer
from kvfabric.testing.clientkit import SPEC, TOKENS_PER_CHUNK, objects_for, prompt
from kvfabric.testing.cluster import directory_process, segment_process

LEASES: Final = 1_000
ROUNDS: Final = 5
LOOKUPS_CONCURRENT_MAX: Final = 8


async def close_s(nats_url: str, seed: int) -> float:
    kv = AsyncKvClient(ClientSettings(nats_url=nats_url), SPEC)
    await kv.start()
    tokens = prompt(TOKENS_PER_CHUNK, seed=seed)
    assert (await kv.save(tokens, objects_for(tokens, 0, 1))).chunks_saved == 1
    gate = asyncio.Semaphore(LOOKUPS_CONCURRENT_MAX)

    async def leased() -> int:
        async with gate:
            return len((await kv.lookup(tokens)).shard_leases)

    assert sum(await asyncio.gather(*(leased() for _ in range(LEASES)))) == LEASES
    began = time.perf_counter()
    await kv.close()
    return time.perf_counter() - began


def main() -> int:
    with (
        tempfile.TemporaryDirectory() as tmp,
        NatsServer(Path(tmp) / "nats") as server,
        directory_process(server),
        segment_process(server, "seg-close", 64 << 20),
    ):
        times = [asyncio.run(close_s(server.url, seed)) for seed in range(ROUNDS)]
    print(f"close with {LEASES} leases held, s: {[round(t, 3) for t in times]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

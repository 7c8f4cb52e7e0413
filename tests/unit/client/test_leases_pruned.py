"""The client forgets read leases past their expiry (the directory expired them): a hit an
engine never released stayed counted held for good (`kvfabric_client_leases_held`) and the
table grew by each (review, stop 67). Leases being given back, and those within the clock-skew
margin, stay."""

from __future__ import annotations

import time

from kvfabric.client import AsyncKvClient, ClientSettings
from kvfabric.client.aio_lookups import LEASES_PRUNE_EVERY_S, LEASES_PRUNE_MARGIN_MS
from tests.integration.clientkit import SPEC


def test_expired_leases_are_forgotten_at_most_every_few_seconds() -> None:
    kv = AsyncKvClient(ClientSettings(nats_url="nats://unused:1"), SPEC)
    now_ms = int(time.time() * 1000)
    kv._leases = {
        (0, 1): now_ms - LEASES_PRUNE_MARGIN_MS - 1_000,  # long expired: forgotten
        (0, 2): now_ms - LEASES_PRUNE_MARGIN_MS // 2,  # expired by our clock, within the margin
        (0, 3): now_ms + 30_000,  # live
        (1, 4): 0,  # being given back: until its answer
    }
    kv._prune_leases()
    assert set(kv._leases) == {(0, 1), (0, 2), (0, 3), (1, 4)}  # not yet: pruned every few seconds
    kv._leases_pruned_s -= LEASES_PRUNE_EVERY_S
    kv._prune_leases()
    assert set(kv._leases) == {(0, 2), (0, 3), (1, 4)}

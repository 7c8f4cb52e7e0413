"""One tenant's disk reads in flight hold at most a quarter of the read budget (review,
2026-12-06): a reader that took its GET's replies slowly held the whole `read_bytes_max` for the
transfer's deadline (minutes), and every other tenant's disk GETs were `busy` meanwhile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfabric.core.disk_records import BLOCK_BYTES
from kvfabric.core.quotas import DOMAIN_DIGEST
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import Busy
from kvfabric.segment_storage.ssd import READ_TENANT_SHARE_DIVISOR, SsdIo, SsdRead, SsdTier

from .test_ssd_backend import SEGMENT

OBJECT = 4 * BLOCK_BYTES
BUDGET = 4 * READ_TENANT_SHARE_DIVISOR * OBJECT  # a tenant's share: 4 objects


def key_of(tenant: bytes, i: int) -> bytes:
    key = bytearray(96)
    key[DOMAIN_DIGEST] = tenant.ljust(DOMAIN_DIGEST.stop - DOMAIN_DIGEST.start, b"-")
    key[-1] = i
    return bytes(key)


def test_a_tenant_holds_at_most_its_share_and_the_others_still_read(tmp_path: Path) -> None:
    io = SsdIo(0, 64, BLOCK_BYTES)
    tier = SsdTier(tmp_path / "ssd", SEGMENT, 1 << 24, 64, direct=False, io=io, read_bytes_max=BUDGET)
    held: list[SsdRead] = []  # reads whose replies are not taken (their buffers lent)
    try:
        stored = {}
        for tenant in (b"alice", b"bob"):
            for i in range(6):
                data = os.urandom(OBJECT)
                stored[tenant, i] = (*tier.write(memoryview(data), key_of(tenant, i), checksum(data)), data)

        def read(tenant: bytes, i: int) -> SsdRead:
            slot, generation, data = stored[tenant, i]
            got = tier.read(slot, generation, len(data))
            assert got.status == "ok" and got.view is not None and bytes(got.view) == data
            return got

        held += [read(b"bob", i) for i in range(4)]  # bob's share, never given back
        with pytest.raises(Busy, match="share"):
            read(b"bob", 4)
        held += [read(b"alice", i) for i in range(4)]  # alice reads as if bob were not there
        held.pop(0).release()
        held.append(read(b"bob", 5))  # bob again, once one of his ended
    finally:
        for one in held:
            one.release()
        assert tier.read_bytes_in_flight == 0 and tier._read_bytes_by_tenant == {}
        tier.close()
        io.close()

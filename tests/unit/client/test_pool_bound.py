"""A client never holds more than `connections_per_segment_max` connections to one segment at once:
transfers beyond that wait for a connection (segments refuse connections past their own
`connections_max`, shared by every client), and get one as soon as it is given back."""

from __future__ import annotations

import threading
import time

import pytest

from kvfabric.client import transfers
from kvfabric.client.transfers import SegmentPool


class FakeTcp:
    opened = 0
    live = 0
    peak = 0
    lock = threading.Lock()

    @classmethod
    def connect(cls, data_addr: str, **_: object) -> FakeTcp:
        with cls.lock:
            cls.opened += 1
            cls.live += 1
            cls.peak = max(cls.peak, cls.live)
        return cls()

    def close(self) -> None:
        with FakeTcp.lock:
            FakeTcp.live -= 1

    def peer_closed(self) -> bool:
        return False


def test_transfers_past_the_bound_wait_for_a_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "TcpDataClient", FakeTcp)
    pool = SegmentPool(connections_per_segment_max=3, timeout_s=5, use_shm=False)
    in_use = 0
    peak_in_use = 0
    lock = threading.Lock()

    def transfer() -> None:
        nonlocal in_use, peak_in_use
        with pool._connection("tcp://seg:1"):
            with lock:
                in_use += 1
                peak_in_use = max(peak_in_use, in_use)
            time.sleep(0.02)
            with lock:
                in_use -= 1

    threads = [threading.Thread(target=transfer) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert peak_in_use == 3 and FakeTcp.peak == 3  # never more open at once
    assert FakeTcp.opened == 3  # the waiting transfers reused the ones given back
    pool.close()
    assert FakeTcp.live == 0


def test_a_transfer_that_never_gets_a_connection_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "TcpDataClient", FakeTcp)
    pool = SegmentPool(connections_per_segment_max=1, timeout_s=0.1, use_shm=False)
    with pool._connection("tcp://seg:2"), pytest.raises(TimeoutError):  # noqa: SIM117
        with pool._connection("tcp://seg:2"):
            pass
    pool.close()

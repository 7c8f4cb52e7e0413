"""The client's connection pool lets go of idle connections whose segment arena was removed:
their shared-memory maps would otherwise keep a dead incarnation's pages alive."""

from __future__ import annotations

from typing import cast

from kvfabric.client.transfers import SegmentPool, _Connection
from kvfabric.dataplane.shm import ShmReader
from kvfabric.dataplane.tcp import TcpDataClient


class FakeTcp:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeShm:
    def __init__(self, gone: bool) -> None:
        self._gone = gone
        self.closed = False

    def gone(self) -> bool:
        return self._gone

    def close(self) -> None:
        self.closed = True


def conn(gone: bool | None) -> _Connection:
    shm = None if gone is None else cast(ShmReader, FakeShm(gone))
    return _Connection(cast(TcpDataClient, FakeTcp()), shm)


def test_idle_connections_to_removed_arenas_are_closed() -> None:
    pool = SegmentPool(connections_per_segment_max=4, timeout_s=1.0, use_shm=True)
    dead, alive, plain = conn(True), conn(False), conn(None)
    pool._idle[("tcp://a:1", True)] = [dead, alive]
    pool._idle[("tcp://b:1", False)] = [plain]
    pool._sweep()
    assert pool._idle[("tcp://a:1", True)] == [alive]
    assert pool._idle[("tcp://b:1", False)] == [plain]
    assert cast(FakeShm, dead.shm).closed and cast(FakeTcp, dead.tcp).closed
    assert not cast(FakeShm, alive.shm).closed
    pool._idle[("tcp://a:1", True)].append(conn(True))
    pool._sweep()  # within the interval: not swept again yet
    assert len(pool._idle[("tcp://a:1", True)]) == 2

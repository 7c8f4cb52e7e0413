"""An idle pooled connection the segment closed (its idle timeout, a restart at the same
address) is not handed to a transfer: the first load or save after it failed on a socket the
kernel already knew was closed (review, 2026-12-06). `TcpDataClient.peer_closed` says so
without blocking; the pool drops such connections and opens a fresh one."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from kvfabric.client.transfers import SegmentPool, _Connection
from kvfabric.dataplane.tcp import TcpDataClient


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server


def connected(listener: socket.socket) -> tuple[TcpDataClient, socket.socket]:
    client = TcpDataClient("127.0.0.1", listener.getsockname()[1], timeout_s=5.0)
    served, _ = listener.accept()
    return client, served


def eventually(check: object, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_connection_the_peer_closed_is_seen_closed_without_blocking(listener: socket.socket) -> None:
    client, served = connected(listener)
    try:
        assert not client.peer_closed()  # open and quiet
        served.close()
        assert eventually(client.peer_closed)
    finally:
        client.close()


def unpin_reply(request_id: int) -> bytes:
    from kvfabric.dataplane.frames import Op
    from kvfabric.dataplane.tcp_wire import encode_frame
    from kvfabric.proto.dataplane import UnpinReply

    return b"".join(
        bytes(part) for part in encode_frame(Op.UNPIN_LOCAL, request_id, UnpinReply(released=1), 0)
    )


def test_a_pipelined_unpins_waiting_reply_is_read_not_taken_for_a_close(listener: socket.socket) -> None:
    client, served = connected(listener)
    try:
        client._unacked = 7  # an UNPIN_LOCAL sent, its reply not read yet
        served.sendall(unpin_reply(7))
        time.sleep(0.05)
        assert not client.peer_closed()  # the reply was read: open and quiet
        assert client._unacked is None
        served.sendall(b"out of step")  # nothing owed now
        assert eventually(client.peer_closed)
    finally:
        served.close()
        client.close()


def test_a_connection_closed_behind_a_pipelined_unpins_reply_is_seen_closed(listener: socket.socket) -> None:
    """Every local read through pins returns its connection with the unpin's reply waiting; the
    segment's idle timeout then closes it. Peeking saw the reply's first byte, not the EOF
    behind it, so the pool handed the dead connection out (review of the day, 2026-12-06)."""
    client, served = connected(listener)
    try:
        client._unacked = 9
        served.sendall(unpin_reply(9))
        served.close()
        time.sleep(0.05)
        assert client.peer_closed()
    finally:
        client.close()


def test_the_pool_drops_idle_connections_the_segment_closed(listener: socket.socket) -> None:
    addr = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    pool = SegmentPool(connections_per_segment_max=4, timeout_s=5.0, use_shm=False)
    stale, stale_served = connected(listener)
    alive, alive_served = connected(listener)
    try:
        pool._idle[(addr, False)] = [_Connection(alive, None), _Connection(stale, None)]
        stale_served.close()  # the segment timed it out (or restarted)
        assert eventually(stale.peer_closed)
        with pool._checked_out(addr, False, [], None) as conn:
            assert conn.tcp is alive
        assert pool.idle_dropped == 1
        assert stale._sock.fileno() == -1  # closed, not pooled again
        assert [c.tcp for c in pool._idle[(addr, False)]] == [alive]
    finally:
        alive_served.close()
        pool.close()


def test_a_refused_map_fails_the_attempt_with_the_segments_own_cause(listener: socket.socket) -> None:
    """MAP is a co-located connection's first request: refused (`busy` past the segment's
    connection bound, `unauthorized`) the segment closes the connection. That was taken for
    "not co-located" and the transfer went on over the closed socket, reported `unavailable`
    (review, stop 68). The attempt fails with the segment's own error, its connection closed."""
    import threading

    from kvfabric.dataplane.frames import HEADER, Op, unpack_header
    from kvfabric.dataplane.tcp_wire import encode_frame
    from kvfabric.format.errors import Busy
    from kvfabric.proto.common import error_reply_from
    from kvfabric.proto.dataplane import ReadRef

    def refuse() -> None:
        served, _ = listener.accept()
        with served:
            header = unpack_header(served.recv(HEADER.size, socket.MSG_WAITALL))
            served.recv(header.meta_bytes, socket.MSG_WAITALL)
            reply = encode_frame(
                Op.ERROR, header.request_id, error_reply_from(Busy("connections at their limit"))
            )
            served.sendall(b"".join(bytes(part) for part in reply))

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    pool = SegmentPool(connections_per_segment_max=2, timeout_s=5.0, use_shm=True)
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    ref = ReadRef(incarnation=1, slot=0, slot_generation=1, size_bytes=16)
    with pytest.raises(Busy), pool._checked_out(address, True, [ref], None):
        raise AssertionError("the connection was handed out")
    thread.join(5)
    pool.close()

"""Writes into an engine's buffers under a gate (`kvfabric.dataplane.scatter`): scatter lists get
the object's bytes in order with the right digest; once the owner closed the gate nothing is
written, from a buffer or from a socket, even when the bytes arrive afterwards."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvfabric.dataplane.scatter import BLOCK_BYTES, GateClosed, ScatterDest, WriteGate, scatter_dests
from kvfabric.format.checksum import checksum
from kvfabric.format.errors import BadRequest

SIZE = 2 * BLOCK_BYTES + 12345


def scatter_of(sizes: list[int], gate: WriteGate | None = None) -> tuple[list[bytearray], ScatterDest]:
    buffers = [bytearray(n) for n in sizes]
    return buffers, ScatterDest([memoryview(b) for b in buffers], gate)


def test_a_scatter_list_gets_the_bytes_in_order_with_their_digest() -> None:
    data = os.urandom(SIZE)
    buffers, dest = scatter_of([1000, BLOCK_BYTES + 7, SIZE - 1000 - BLOCK_BYTES - 7], WriteGate())
    assert dest.write_from(memoryview(data), hashed=True) == checksum(data)
    assert b"".join(buffers) == data


def test_a_closed_gate_refuses_every_write() -> None:
    gate = WriteGate()
    buffers, dest = scatter_of([SIZE], gate)
    gate.close()
    with pytest.raises(GateClosed):
        dest.write_from(memoryview(os.urandom(SIZE)), hashed=True)
    assert buffers[0] == bytes(SIZE)


def test_sizes_must_match() -> None:
    with pytest.raises(BadRequest):
        scatter_dests([bytearray(10)], [11])
    with pytest.raises(BadRequest):
        scatter_dests([bytes(10)], [10])  # type: ignore[list-item]  # read-only


@pytest.mark.parametrize("gated", [False, True])
def test_a_socket_fills_a_scatter_list(gated: bool) -> None:
    data = os.urandom(SIZE)
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        buffers, dest = scatter_of([3, SIZE - 3], WriteGate() if gated else None)
        sender = threading.Thread(target=a.sendall, args=(data,))
        sender.start()
        assert dest.recv_from(b, hashed=True) == checksum(data)
        sender.join()
    assert b"".join(buffers) == data


def test_a_receiver_waiting_for_bytes_stops_when_the_gate_closes_and_never_writes_them() -> None:
    gate = WriteGate()
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(30)
        buffers, dest = scatter_of([SIZE], gate)
        outcome: list[str] = []

        def receive() -> None:
            try:
                dest.recv_from(b, hashed=True)
                outcome.append("received")
            except GateClosed:
                outcome.append("closed")

        receiver = threading.Thread(target=receive)
        receiver.start()
        a.sendall(b"x" * 100)  # part of the object, then the owner takes the buffer back
        time.sleep(0.2)
        started = time.monotonic()
        gate.close()
        assert time.monotonic() - started < 0.1  # close never waits for the socket
        a.sendall(b"y" * 1000)  # bytes that arrive afterwards
        receiver.join(2)
        assert not receiver.is_alive() and outcome == ["closed"]
    assert bytes(buffers[0][:100]) == b"x" * 100 and buffers[0][100:] == bytes(SIZE - 100)


def test_a_joiner_copies_across_scatter_layouts_only_while_its_gate_is_open() -> None:
    data = os.urandom(SIZE)
    _, source = scatter_of([SIZE - 5000, 5000])
    source.write_from(memoryview(data), hashed=False)
    gate = WriteGate()
    buffers, dest = scatter_of([7, BLOCK_BYTES, SIZE - 7 - BLOCK_BYTES], gate)
    dest.copy_from(source)
    assert b"".join(buffers) == data
    gate.close()
    fresh, closed = scatter_of([SIZE], gate)
    with pytest.raises(GateClosed):
        closed.copy_from(source)
    assert fresh[0] == bytes(SIZE)


def test_a_joiner_never_copies_from_a_source_whose_gate_closed() -> None:
    """Review, 2026-12-05: the joiner checked the source's gate once, then copied holding only
    its own lock; the source's owner may close its gate from another thread and reuse the buffer
    at once. Each piece is copied under both gates: a source closed before the copy (or mid-way)
    ends it with `GateClosed`."""
    data = os.urandom(SIZE)
    source_gate = WriteGate()
    _, source = scatter_of([SIZE], source_gate)
    source.write_from(memoryview(data), hashed=False)
    buffers, dest = scatter_of([SIZE], WriteGate())
    source_gate.close()
    with pytest.raises(GateClosed):
        dest.copy_from(source)
    assert buffers[0] == bytes(SIZE)

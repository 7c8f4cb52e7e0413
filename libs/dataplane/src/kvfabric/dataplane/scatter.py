"""Where a read's bytes land: an engine's own buffers, written block by block under a gate.

A client load writes each object straight into the engine's destination (no staging buffer, no
second copy): one writable view, or a scatter list of views (one paged-KV block of every layer,
say) whose sizes add up to the object's size. The engine lends those buffers for the length of
one `load` call and may reuse them the moment it returns (docs/design.md invariant 3, client side):

- **`WriteGate`** is that loan. A transport writes (and hashes) one block of at most
  `BLOCK_BYTES` at a time, each under the gate's lock, and checks the gate is still open first.
  The owner's `close()` takes the same lock: once it returns, no block write is in progress and
  none can start, whatever thread the transfer runs on. A transfer that finds the gate closed
  stops with `GateClosed` (its connection is then out of step and is dropped).
- A socket read never waits for data while it holds the lock: it polls first, then receives
  what is already there without blocking (`MSG_DONTWAIT`). TLS sockets cannot take flags: they
  receive into a small per-call bounce buffer outside the lock and copy it in under the lock.
- Copies from a shared-memory arena go through numpy, which releases the GIL for the copy (a
  `memoryview` slice assignment holds it), so transfers on several threads and the client's event
  loop run side by side. Each block is hashed right after it lands, while it is still in cache.

Who owns what: the caller owns the views and the gate; a `ScatterDest` only borrows them for one
transport call. Bytes written before a failure stay in the buffers but are never reported as
loaded: the caller checks the digest against the checksum it trusts, and the engine recomputes
(overwrites) a chunk that is not reported loaded.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
from collections.abc import Sequence
from typing import Final

import numpy as np

from kvfabric.format.checksum import StreamingChecksum
from kvfabric.format.errors import BadRequest

__all__ = ["BLOCK_BYTES", "GateClosed", "ScatterDest", "WriteGate", "scatter_dests"]

# Copy/receive + hash granularity. 1 MiB, not smaller: measured on this AMD EPYC, glibc copies
# 2 KiB–512 KiB blocks with `rep movsb`, which ran at half speed when the destination was not
# 64-byte aligned to the source; from 1 MiB it takes the vector loop. Also the most a gate's
# `close()` waits for (one block copy, ~0.1 ms).
BLOCK_BYTES: Final = 1 << 20


GATE_POLL_MS: Final = 50  # a receiver waiting for data notices a closed gate within this


class GateClosed(Exception):
    """The owner of the destination took it back: the transfer must stop writing now."""


class WriteGate:
    """The loan of an engine's buffers to transfers, ended by `close()` (see the module doc)."""

    __slots__ = ("_lock", "_open")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True

    @property
    def is_open(self) -> bool:
        return self._open

    def close(self) -> None:
        """Returns once no block write is in progress; none starts afterwards."""
        with self._lock:
            self._open = False


class ScatterDest:
    """One object's destination: views whose sizes add up to `size`, optionally gated.

    `write_from(source)` copies (and hashes) from a buffer (a shared-memory arena); `recv_from(sock)`
    receives exactly `size` bytes from a stream. Both return the XXH3-128 digest of what landed
    when `hashed`, else b""; both raise `GateClosed` when the gate closed before they ended."""

    __slots__ = ("gate", "size", "views")

    def __init__(self, views: Sequence[memoryview], gate: WriteGate | None = None) -> None:
        self.views = list(views)
        self.size = sum(len(v) for v in self.views)
        self.gate = gate

    def _blocks(self) -> list[memoryview]:
        return [view[i : i + BLOCK_BYTES] for view in self.views for i in range(0, len(view), BLOCK_BYTES)]

    def write_from(self, source: memoryview, hashed: bool) -> bytes:
        if len(source) != self.size:
            raise BadRequest(f"source is {len(source)} bytes, destination {self.size}")
        digest = StreamingChecksum() if hashed else None
        lock = self.gate._lock if self.gate is not None else None
        offset = 0
        for block in self._blocks():
            n = len(block)
            target = np.frombuffer(block, np.uint8)
            if lock is not None:
                lock.acquire()
            try:
                if self.gate is not None and not self.gate._open:
                    raise GateClosed
                np.copyto(target, np.frombuffer(source[offset : offset + n], np.uint8))  # GIL released
                if digest is not None:
                    digest.update(block)  # just written: hashed from cache
            finally:
                if lock is not None:
                    lock.release()
            offset += n
        return digest.digest() if digest is not None else b""

    def copy_from(self, source: ScatterDest) -> None:
        """Copy another destination's bytes (same total size) into this one, block by block under
        this gate and the source's (a load that joined another's transfer takes its bytes from
        there). `GateClosed` when either closed first: each piece is copied while both are open,
        so never from a buffer its owner took back meanwhile (it may close the source's gate
        from another thread, and then reuse the buffer at once; review, 2026-12-05)."""
        if source.size != self.size:
            raise BadRequest(f"source is {source.size} bytes, destination {self.size}")
        pieces = iter(source._blocks())
        piece = memoryview(b"")
        lock = self.gate._lock if self.gate is not None else None
        source_lock = source.gate._lock if source.gate is not None else None
        for block in self._blocks():
            filled = 0
            while filled < len(block):
                if not piece:
                    piece = next(pieces)
                n = min(len(piece), len(block) - filled)
                if source_lock is not None:  # always before this gate's lock: one order
                    source_lock.acquire()
                if lock is not None:
                    lock.acquire()
                try:
                    if self.gate is not None and not self.gate._open:
                        raise GateClosed
                    if source.gate is not None and not source.gate._open:
                        raise GateClosed
                    # GIL released: a slice assignment held it, stalling the transfer threads
                    # for a joined load's whole copy on the loop (review, stop 67)
                    np.copyto(
                        np.frombuffer(block[filled : filled + n], np.uint8),
                        np.frombuffer(piece[:n], np.uint8),
                    )
                finally:
                    if lock is not None:
                        lock.release()
                    if source_lock is not None:
                        source_lock.release()
                filled += n
                piece = piece[n:]

    def recv_from(self, sock: socket.socket, hashed: bool) -> bytes:
        """Receive exactly `size` bytes. Raises `ConnectionError` when the peer closed, and
        `TimeoutError` after the socket's timeout without data."""
        digest = StreamingChecksum() if hashed else None
        gate = self.gate
        if gate is None:
            for block in self._blocks():
                _recv_block(sock, block, digest)
        elif isinstance(sock, ssl.SSLSocket):
            bounce = memoryview(bytearray(min(self.size, BLOCK_BYTES)))
            for block in self._blocks():
                got = 0
                while got < len(block):
                    n = sock.recv_into(bounce[: len(block) - got])  # outside the lock: may wait
                    if n == 0:
                        raise ConnectionError("peer closed the connection")
                    with gate._lock:
                        if not gate._open:
                            raise GateClosed
                        block[got : got + n] = bounce[:n]
                        if digest is not None:
                            digest.update(block[got : got + n])
                    got += n
        else:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            timeout = sock.gettimeout()
            for block in self._blocks():
                got = 0
                while got < len(block):
                    _wait_readable(poller, gate, timeout)  # no lock held while waiting for data
                    with gate._lock:
                        if not gate._open:
                            raise GateClosed
                        try:  # data is there: this only copies what arrived, never waits
                            n = sock.recv_into(block[got:], len(block) - got, socket.MSG_DONTWAIT)
                        except BlockingIOError:
                            continue
                        if n == 0:
                            raise ConnectionError("peer closed the connection")
                        if digest is not None:
                            digest.update(block[got : got + n])
                    got += n
        return digest.digest() if digest is not None else b""


def _wait_readable(poller: select.poll, gate: WriteGate, timeout_s: float | None) -> None:
    """Wait for data in slices of `GATE_POLL_MS`, so a transfer whose gate closed stops soon
    (it holds a connection and a worker thread) instead of at the socket timeout."""
    waited_ms = 0
    while True:
        if not gate._open:
            raise GateClosed
        if poller.poll(GATE_POLL_MS):
            return
        waited_ms += GATE_POLL_MS
        if timeout_s is not None and waited_ms >= timeout_s * 1000:
            raise TimeoutError("no data from the segment within the socket timeout")


def _recv_block(sock: socket.socket, block: memoryview, digest: StreamingChecksum | None) -> None:
    got = 0
    while got < len(block):
        n = sock.recv_into(block[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        if digest is not None:
            digest.update(block[got : got + n])
        got += n


def _byte_view(buffer: memoryview | bytearray) -> memoryview:
    try:
        view = memoryview(buffer)
    except TypeError:
        raise BadRequest(f"destination {type(buffer).__name__} is not a buffer") from None
    if view.readonly:
        raise BadRequest("destination buffer is read-only")
    if not view.c_contiguous:
        raise BadRequest("destination buffer is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def scatter_dests(
    dests: Sequence[memoryview | bytearray | ScatterDest | Sequence[memoryview]],
    sizes: Sequence[int],
    gate: WriteGate | None = None,
) -> list[ScatterDest]:
    """One `ScatterDest` per object: a buffer, a scatter list, or a ready `ScatterDest`, each
    exactly its object's size (else `BadRequest`)."""
    if len(dests) != len(sizes):
        raise BadRequest("one destination per read")
    out: list[ScatterDest] = []
    for dest, size in zip(dests, sizes, strict=True):
        if isinstance(dest, ScatterDest):
            scatter = dest
        elif isinstance(dest, (list, tuple)):
            scatter = ScatterDest([_byte_view(d) for d in dest], gate)
        else:  # one buffer (anything with the buffer protocol)
            scatter = ScatterDest([_byte_view(dest)], gate)  # type: ignore[arg-type]
        if scatter.size != size:
            raise BadRequest(f"destination is {scatter.size} bytes, object is {size}")
        out.append(scatter)
    return out

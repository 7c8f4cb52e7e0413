"""Reading one stored object from another segment straight into a slot (the `copy` endpoint).

`fetch_replica` is a blocking call for a worker thread: it connects to the source segment's TCP
data port, GETs the named replica into the caller's buffer (the destination slot's view: no
intermediate copy) and closes. It is bounded by `timeout_s` overall: connecting waits at most
that long, and a watchdog shuts the socket down when the deadline passes, so a source that stalls
or trickles cannot hold the slot. It does not verify the bytes: the caller (`ArenaBackend.copy_in`
→ `finish_put`) checks them against the ticket's checksum.

Errors (all `KvfError`, nothing is written to a buffer the caller may then use; each carries the
detail `source_addr`, which tells the copy's caller the source failed, not the destination's
ticket: another source replica may do):
- `Unavailable`: the source cannot be reached, dropped the connection, or the deadline passed;
- `StaleGeneration`: the source no longer holds that generation (kind `source_slot_generation`)
  or is another incarnation (`source_incarnation`, on a connection that is already admitted:
  the copier's own is new each time, so a restarted source answers `Unauthorized` below);
  `current` is 0: the source does not say;
- `NotFound`: the source never stored that slot generation (or it is still being written);
- `BadRequest`: the size differs from what the source stores, or the address has no TCP transport;
- `Busy`: the source is at its data-connection limit (retry later);
- `Unauthorized`: the source refused the read token (invalid, expired by its clock, or naming
  another incarnation of it: a source restarted since the copy was planned).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time

from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.errors import BadRequest, Indeterminate, KvfError, NotFound, StaleGeneration, Unavailable
from kvfabric.proto.dataplane import ReadRef

__all__ = ["fetch_replica"]


def fetch_replica(
    source_addr: str, ref: ReadRef, dest: memoryview, timeout_s: float, tls: ssl.SSLContext | None = None
) -> None:
    """GET `ref` from the segment at `source_addr` into `dest` (exactly `ref.size_bytes`);
    `tls` verifies a source that serves tls://."""
    try:
        _fetch(source_addr, ref, dest, timeout_s, tls)
    except KvfError as err:
        err.details.setdefault("source_addr", source_addr)  # the source's fault (see the module)
        raise


def _fetch(
    source_addr: str, ref: ReadRef, dest: memoryview, timeout_s: float, tls: ssl.SSLContext | None
) -> None:
    deadline_s = time.monotonic() + timeout_s
    try:
        client = TcpDataClient.connect(source_addr, timeout_s=timeout_s, tls=tls)
    except OSError as exc:
        raise Unavailable(f"cannot reach the source segment: {exc!r}", source_addr=source_addr) from None
    expired = threading.Event()

    def cut() -> None:  # wakes a recv blocked in the worker thread
        expired.set()
        with contextlib.suppress(OSError):
            client._sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(max(0.0, deadline_s - time.monotonic()), cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        results = client.get([ref], [dest])
    except KvfError as err:
        if expired.is_set():
            raise Unavailable("copy from the source timed out", timeout_s=timeout_s) from None
        if isinstance(err, Indeterminate):  # a read changes nothing: the copy simply failed
            raise Unavailable(f"source connection failed: {err.message}", source_addr=source_addr) from None
        raise
    finally:
        watchdog.cancel()
        client.close()
    status = results[0].status
    if status == "ok":
        return
    if status == "stale_generation":
        raise StaleGeneration("source_slot_generation", ref.slot_generation, 0)
    if status == "stale_incarnation":
        raise StaleGeneration("source_incarnation", ref.incarnation, 0)
    if status == "wrong_size":
        raise BadRequest("the source stores another size", size_bytes=ref.size_bytes)
    raise NotFound(f"the source does not hold the replica ({status})", slot=ref.slot)

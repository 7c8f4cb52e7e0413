"""The plain TCP data-plane transport: a threaded server over a `SegmentBackend` and a blocking client.

Bytes move without intermediate copies: the server `recv_into`s a PUT's payload straight into the
arena slot the backend handed out, and sends a GET's objects straight from arena views with
`sendmsg`; the client sends from the caller's buffer and `recv_into`s the caller's destination
buffers. A GET whose client asks `verdicts_after` may get objects still being read (a disk
replica, `begin_get_streamed`): each piece is sent as it lands and a second `GetReply` with the
final results follows the payload; the client takes those. Threads, not asyncio: large
`recv_into`/`sendmsg` calls release the GIL, and a thread per connection (at most
`connections_max`) is the cheapest way to keep both cores busy.

Failure rules:
- A connection that drops mid-PUT aborts the slot (nothing visible, nothing leaked); any drop
  releases every reference the connection held (`backend.close_connection`).
- An error on a PUT (bad ticket, no capacity, checksum mismatch) is answered with an ERROR frame
  after the payload has been read and dropped (so the stream stays in step); the connection stays
  usable. A payload size outside 0..`OBJECT_BYTES_MAX` is not read: error, then the connection
  closes.
- An error on other ops is answered with an ERROR frame and the connection stays usable.

Before authentication (`kvfabric.dataplane.admission`, given an `authenticate` function, as the
segment does): the first request must carry a valid credential (a PUT's ticket, a GET's or
PIN_LOCAL's read tokens, a MAP's `reads`/`ticket`) within the auth deadline of the accept; a
request without one is answered `unauthorized` and the connection closed, before the backend
sees it. Every deadline is absolute: a watchdog thread shuts down a connection past it.

The code: socket framing `tcp_wire`, the server `tcp_server`, the client `tcp_client`; this module
keeps the public names.
"""

from __future__ import annotations

from kvfabric.dataplane.admission import CONNECTIONS_MAX_DEFAULT
from kvfabric.dataplane.tcp_client import TcpDataClient, verified
from kvfabric.dataplane.tcp_server import TcpDataServer
from kvfabric.dataplane.tcp_wire import Destination, shutdown_fd, tune_socket

__all__ = [
    "CONNECTIONS_MAX_DEFAULT",
    "Destination",
    "TcpDataClient",
    "TcpDataServer",
    "shutdown_fd",
    "tune_socket",
    "verified",
]

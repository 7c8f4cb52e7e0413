"""The data-plane protocol over UCX (ucxx, asyncio): `UcxServer` over a `SegmentBackend`, `UcxClient`.

Same frames as TCP (`kvfabric.dataplane.frames`), carried as UCX tag messages on the connection's
own tag pair (agreed at connect time, as ucxx's own asyncio API does; messages on one tag are
matched in order):

| message | bytes | received into |
|---|---|---|
| request / reply | 24-byte header + msgpack meta | a per-connection `FRAME_BYTES_MAX` buffer |
| PUT payload | exactly `ticket.size_bytes` | the arena view from `backend.begin_put` |
| GET payload | one message per `ok` object, `size_bytes` each | the caller's destination buffer |

Progress engine: ucxx's low-level worker (`ucxx._lib.libucxx`), one UCX context and worker per
event loop, progressed by that loop and nothing else (`ucx_link.Worker`): the worker's epoll fd is a
reader of the loop; each turn progresses UCX until idle, resolves the futures of the requests that
completed, and re-arms the worker. No ucxx threads, no thread hop per message. ucxx's asyncio
layer (`ucxx.create_endpoint`: a progress thread, delayed submission, a notifier thread setting
asyncio futures: a thread hand-off per submission and per completion) cost ~0.7-1.2 ms per
request on 2 shared cores (docs/ucx.md, `bench/ucx_options.py`). A client sends its request and
posts the reply's receive together (pre-posted), so the reply lands without UCX's
unexpected-message queue. `UcxSyncClient` is the blocking variant: its caller's thread progresses
its own worker.

Why header + meta is one message: a UCX tag receive may be larger than the message (it may not be
smaller: the message is then consumed and the receive fails "truncated"), and the header says how
many meta bytes are valid. One message halves the small-request round trip against two (header,
then meta). Truncation keeps the stream in step: an oversize message is consumed, answered with
`bad_request`, and the connection stays usable.

Payload messages are posted straight on their final buffers (arena view, caller's buffer): no copy
in Python. Inside UCX, an eager message (below `UCX_RNDV_THRESH`) that arrives before its receive is
posted is buffered and copied once; a rendezvous message waits at the sender until matched.

Before authentication (as the TCP transport, `kvfabric.dataplane.admission`): a connection
addressed to anything but the server's `host` is closed at once (ucxx's listener binds every
interface); with an `authenticate` function, the handshake and a first request that carries a
valid credential must arrive within the auth deadline, or the connection is closed; until then
nothing reaches the backend. Unauthenticated connections are bounded apart (the oldest is closed
to make room); authenticated ones in total and per peer address; an authenticated connection
silent for the idle timeout is closed (a UCX message arrives whole: no trickle reaches us).

Failure rules (as the TCP transport):
- A refused PUT (`begin_put` raised, too large, malformed) is answered with an ERROR frame after its
  payload message has been consumed (received into a 1-byte buffer: UCX drops the rest), so the
  connection stays usable. Any refused request consumes the `payload_count` messages it declared.
- A connection that drops mid-PUT aborts the slot; any drop releases everything the connection held
  (`backend.close_connection`).
- A payload transfer that does not finish within `io_timeout_s` aborts the connection.
- An arena view is released (`finish_put`/`abort_put`/`end_get`/`close_connection`) only after UCX
  has finished with it (completed or cancelled). If UCX never confirms (not observed), the
  connection's references are leaked on purpose (`UcxServer.leaked_connections`), never reused
  while UCX may still write or read them.

Threading: a server or client belongs to the event loop it started (connected) on, whose worker
carries its transfers; the backend is called synchronously on that loop's thread and must not
block on it. Several loops (threads) may each run servers and clients: each has its own worker.

UCX settings: `ucx_env_defaults()` (measured, docs/ucx.md) are applied with
`os.environ.setdefault` just before ucxx is first imported, so anything set in the environment
wins. Import ucxx only through `ucx_link` (ucxx sets `UCX_RNDV_THRESH=8192` at import when unset).

The code: the endpoint layer (settings, worker, link, handshake) `ucx_link`, the server
`ucx_server`, the clients `ucx_client`; this module keeps the public names.
"""

from __future__ import annotations

from kvfabric.dataplane.admission import CONNECTIONS_MAX_DEFAULT
from kvfabric.dataplane.ucx_client import UcxClient, UcxSyncClient
from kvfabric.dataplane.ucx_link import IO_TIMEOUT_S_DEFAULT, apply_ucx_env_defaults, ucx_env_defaults
from kvfabric.dataplane.ucx_server import INFLIGHT_BYTES_MAX_DEFAULT, UcxServer

__all__ = [
    "CONNECTIONS_MAX_DEFAULT",
    "INFLIGHT_BYTES_MAX_DEFAULT",
    "IO_TIMEOUT_S_DEFAULT",
    "UcxClient",
    "UcxServer",
    "UcxSyncClient",
    "apply_ucx_env_defaults",
    "ucx_env_defaults",
]

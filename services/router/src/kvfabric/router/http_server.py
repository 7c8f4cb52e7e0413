"""The router's HTTP connections before any request is authenticated: uvicorn's h11 protocol with
a bound on a request head's bytes and a deadline for it.

Every connection holds one of uvicorn's `limit_concurrency` places (503 past it). A connection
that never sent a request had no deadline (uvicorn's keep-alive timer starts after a response,
and any byte received stops it), so 192 silent sockets, or as many sending a byte a second, took
every place from every tenant for good; and httptools, uvicorn's default parser, read request
heads of any size (305 MiB on one connection; review, stop 66). Now:
- h11 parses, holding at most `HEAD_BYTES_MAX` of an unfinished request head (400 past it);
- each request's head must be whole within `HEAD_DEADLINE_S` of the connection's opening or of
  the answer before it on that connection, or the connection is aborted. A head received in
  time is then the app's: its body has the proxy's own deadline (`BODY_READ_TIMEOUT_S`); a
  client still sending a body after the answer went (a 401, 429 or 408 answered before the
  body was read: uvicorn's keep-alive timer stops at every byte) is aborted at the next check;
- a client that reads nothing of what is written to it for `WRITE_STALL_S` is aborted: closed,
  the socket would wait for the unsent answer to drain, and keep its place (the proxy ends the
  request itself after `SEND_STALL_S`; review of the change).
"""

from __future__ import annotations

import asyncio
from typing import Final

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HEAD_BYTES_MAX", "HEAD_DEADLINE_S", "BoundedH11Protocol"]

HEAD_BYTES_MAX: Final = 64 << 10
HEAD_DEADLINE_S: Final = 10.0
WRITE_STALL_S: Final = 35.0  # past the proxy's own SEND_STALL_S (30 s)


class BoundedH11Protocol(H11Protocol):
    """`H11Protocol` with a deadline for each request head (module docstring)."""

    head_deadline_s: float = HEAD_DEADLINE_S  # (a test's own)
    write_stall_s: float = WRITE_STALL_S
    _head_timer: asyncio.TimerHandle | None = None
    _stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()  # the next request's head, if the connection is kept

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.write_stall_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _write_stalled(self) -> None:
        self._stall_timer = None
        self.transport.abort()  # its unsent answer dropped: the place comes back now

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.head_deadline_s, self._head_overdue)

    def _disarm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        # IDLE: no whole request head since the deadline was armed (a request being read or
        # answered has left IDLE; a kept connection waiting for its next one is IDLE again).
        # SEND_BODY with our answer sent: a body nobody reads any more, trickled to hold the place.
        answered = self.conn.our_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)
        if self.conn.their_state is h11.IDLE or (answered and self.conn.their_state is h11.SEND_BODY):
            self.transport.abort()
            return
        self._arm_head_deadline()  # a request being read or answered: looked at again later

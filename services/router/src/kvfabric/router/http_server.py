"""The router's HTTP connections before any request is authenticated: uvicorn's h11 protocol with
a bound on a request head's bytes and a deadline for it.

Every connection holds one of uvicorn's `limit_concurrency` places (503 past it). A connection
that never sent a request had no deadline (uvicorn's keep-alive timer starts after a response,
and any byte received stops it), so 192 silent sockets, or as many sending a byte a second, took
every place from every tenant for good; and httptools, uvicorn's default parser, read request
heads of any size (305 MiB on one connection; review, stop 66). Now:
- h11 parses, holding at most `HEAD_BYTES_MAX` of an unfinished request head (400 past it);
- each request's head must be whole within `HEAD_DEADLINE_S` of the connection's opening or of
  the answer before it on that connection, or the connection is closed. A head received in
  time is then the app's: its body has the proxy's own deadline (`BODY_READ_TIMEOUT_S`).
"""

from __future__ import annotations

import asyncio
from typing import Final

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HEAD_BYTES_MAX", "HEAD_DEADLINE_S", "BoundedH11Protocol"]

HEAD_BYTES_MAX: Final = 64 << 10
HEAD_DEADLINE_S: Final = 10.0


class BoundedH11Protocol(H11Protocol):
    """`H11Protocol` with a deadline for each request head (module docstring)."""

    head_deadline_s: float = HEAD_DEADLINE_S  # (a test's own)
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()  # the next request's head, if the connection is kept

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

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
        # IDLE: no whole request head since the deadline was armed (a request being read or
        # answered has left IDLE; a kept connection waiting for its next one is IDLE again)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

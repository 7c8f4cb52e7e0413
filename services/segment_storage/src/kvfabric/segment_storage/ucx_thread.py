"""Runs the UCX data server on its own thread and event loop.

Why a thread: `ArenaBackend.finish_put` blocks while the directory confirms a replica, and that
confirmation runs on the service's main loop (NATS). The UCX server calls the backend on its own
loop's thread, so it must not be the main loop. ucxx is imported only here (and in
`kvfabric.dataplane.ucx`), after `apply_ucx_env_defaults()`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Final

from kvfabric.dataplane.admission import Authenticator, ConnectionLimits
from kvfabric.dataplane.backend import SegmentBackend
from kvfabric.dataplane.ucx import UcxServer

__all__ = ["UcxThread"]

START_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 10.0


class UcxThread:
    """`limits`, `authenticate`, `count`: the TCP server's rules (`kvfabric.dataplane.admission`);
    the server accepts only connections addressed to `host`, where the TCP server is bound."""

    def __init__(
        self,
        backend: SegmentBackend,
        host: str,
        port: int = 0,
        *,
        limits: ConnectionLimits | None = None,
        authenticate: Authenticator | None = None,
        count: Callable[[str], None] | None = None,
    ) -> None:
        self.backend, self.host, self.port = backend, host, port
        self.limits, self.authenticate, self.count = limits, authenticate, count
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvf-ucx", daemon=True)
        self.server: UcxServer | None = None

    def start(self) -> str:
        """Start listening; returns the `ucx://host:port` address. Raises what ucxx raises."""
        self._thread.start()

        async def start() -> UcxServer:
            server = UcxServer(
                self.backend,
                self.host,
                self.port,
                limits=self.limits,
                authenticate=self.authenticate,
                count=self.count,
            )
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(start(), self._loop).result(START_TIMEOUT_S)
        return self.server.address

    def stop(self) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_TIMEOUT_S)

"""A client's NATS connection at start: bounded, quiet, and with an error an operator can act on.

`open_nats` is all of `AsyncKvClient.start`'s I/O (issue 22): an engine links the cache as an
option, so a cache it cannot use must never stop it, stall its start-up or fill its log.

- **Bounded.** Connecting, and the first access check, take at most `connect_timeout_ms` in all.
  (nats-py's own first connect never ends while reconnects are allowed: it retries every
  `reconnect_time_wait` for as long as the server is down or does not answer.)
- **Quiet.** The connection's error callback keeps the errors seen while starting (the reason a
  start failed) instead of logging each with a traceback; once started, it logs at most one line
  per `ERROR_LOG_INTERVAL_S` (a NATS outage retries every `RETRY_WAIT_S`).
- **Classified.** What failed decides the error, and so the client's fallback cause:
  `BadRequest` (a setting the client cannot use: an unreadable password file or TLS file, a bad
  URL, a host name that does not resolve), `Unauthorized` (NATS refused the credentials, or the
  tenant's subjects: an unknown tenant; this ends the start at once, retrying cannot help),
  `Unavailable` (no server listening), `Indeterminate` (a server that did not answer in time:
  stopped, or a network that drops packets).
- **Access check.** Once connected, the client asks for the directory's shard map on its own
  subjects (at most the router's gather time, 0.25 s) and waits for the server to have seen it:
  a tenant NATS does not know is refused those subjects (`permissions violation`). A directory
  that does not answer is no error here (it may start later: lookups miss until it does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from typing import Final

import nats.errors
from nats.aio.client import Client as NatsClient

from kvfabric.client.settings import ClientSettings
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.cluster.natsauth import (
    describe_nats_error,
    is_nats_refusal,
    nats_servers,
    nats_servers_problem,
    servers_without_userinfo,
)
from kvfabric.format.errors import BadRequest, Indeterminate, KvfError, Unauthorized, Unavailable

__all__ = ["ERROR_LOG_INTERVAL_S", "RETRY_WAIT_S", "NatsErrors", "open_nats", "start_error"]

log = logging.getLogger("kvfabric.client")

RETRY_WAIT_S: Final = 0.5  # between connect attempts while starting, and between reconnects
ERROR_LOG_INTERVAL_S: Final = 30.0  # once started: at most one logged connection error per interval
# A connect attempt's share of `connect_timeout_ms` with several servers (nats-py's
# `connect_timeout` is per server: the whole budget on one that accepts and never answers left
# none for the next; review, stop 71), at least this.
CONNECT_ATTEMPT_MIN_S: Final = 0.25
# `close` drains the connection for at most this long (nats-py's default, 30 s, was twice the
# 15 s `KvClient.close` allows its steps besides the saves and lookups it waits for)
DRAIN_TIMEOUT_S: Final = 5


def _final(exc: BaseException, servers: int = 1) -> bool:
    """An error another attempt cannot fix: end the start at once. With several servers, a name
    that does not resolve or a TLS failure is one server's (a pod rescheduled, its DNS record
    gone): the next server is tried (nats-py shuffles them; the first one's ended the start,
    disabled for the engine's life, while another was up: review, stop 71). A refusal of the
    credentials is every server's."""
    if is_nats_refusal(exc):
        return True
    return servers == 1 and isinstance(exc, ssl.SSLError | socket.gaierror)


class NatsErrors:
    """The connection's `error_cb` (`on_error`). Until `started`: keeps the last error and the
    first one another attempt cannot fix (`final`, and wakes `ended`); from then on: logs, at
    most one line per `ERROR_LOG_INTERVAL_S`."""

    def __init__(self, servers: int = 1) -> None:
        self.servers = servers  # how many servers the connection may try (`_final`)
        self.started = False
        self.last: BaseException | None = None
        self.final: BaseException | None = None
        self.ended = asyncio.Event()
        self._logged_s = -ERROR_LOG_INTERVAL_S
        self._unlogged = 0

    async def on_error(self, exc: Exception) -> None:
        if not self.started:
            self.last = exc
            if self.final is None and _final(exc, self.servers):
                self.final = exc
                self.ended.set()
            return
        now = time.monotonic()
        if now - self._logged_s < ERROR_LOG_INTERVAL_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last line)" if self._unlogged else ""
        log.warning("kvfabric client: NATS connection error: %s%s", describe_nats_error(exc), more)
        self._logged_s, self._unlogged = now, 0


def _check_url(url: str) -> list[str]:
    """The server URLs of `nats_url` (one URL or a comma list: `nats_servers`), each checked."""
    problem = nats_servers_problem(url)
    if problem is not None:
        raise BadRequest(f"client setting nats_url {servers_without_userinfo(url)!r}: {problem}")
    return nats_servers(url)


def start_error(url: str, exc: BaseException | None, timeout_ms: int) -> BaseException:
    """What a failed start raises (pure): `exc` is the connect's own error, else the last error
    its callback saw, else None (no attempt ended within the time). An error of no kind known
    here is raised as it is (a bug: the client logs its traceback). A password in `url` is never
    in the message."""
    url = servers_without_userinfo(url)
    where = f"NATS at {url}"
    if isinstance(exc, KvfError):
        return exc
    if isinstance(exc, socket.gaierror):
        return BadRequest(f"cannot resolve the host of {where} (client setting nats_url): {exc}")
    if isinstance(exc, ssl.SSLError):
        return BadRequest(f"TLS to {where} failed (client settings nats_tls_*): {exc}")
    if exc is not None and is_nats_refusal(exc):
        return Unauthorized(
            f"{where} refused this client ({describe_nats_error(exc)}): check the user, password and tenant"
            " (client settings nats_user, nats_password_file, nats_tenant)"
        )
    if isinstance(exc, nats.errors.Error) and "url" in str(exc).lower():
        return BadRequest(f"client setting nats_url {url!r}: {exc}")
    if isinstance(exc, OSError) and not isinstance(exc, TimeoutError):
        return Unavailable(f"cannot connect to {where}: {describe_nats_error(exc)}")
    if exc is None or isinstance(exc, TimeoutError | nats.errors.Error):
        return Indeterminate(f"no answer from {where} within {timeout_ms} ms (a stopped server?)")
    return exc


async def open_nats(settings: ClientSettings) -> tuple[NatsClient, DirectoryRouter]:
    """Connect and check access within `settings.connect_timeout_ms`; the connection and its
    directory router, or raises (see the module docstring). Nothing is left open on failure."""
    timeout_s = settings.connect_timeout_ms / 1000
    deadline = time.monotonic() + timeout_s
    servers = _check_url(settings.nats_url)
    try:
        options = settings.nats_auth().connect_options()  # BadRequest: unreadable password file
    except OSError as exc:  # TLS files (ssl.SSLError is an OSError)
        raise BadRequest(
            f"cannot load the client's NATS TLS files (client settings nats_tls_*): {exc}"
        ) from None
    attempt_s = timeout_s if len(servers) == 1 else max(CONNECT_ATTEMPT_MIN_S, timeout_s / len(servers))
    options.update(connect_timeout=attempt_s, reconnect_time_wait=RETRY_WAIT_S)  # seconds, floats
    options.update(drain_timeout=DRAIN_TIMEOUT_S)
    errors = NatsErrors(len(servers))
    nc = NatsClient()
    connecting = asyncio.ensure_future(
        nc.connect(
            servers,
            **options,
            error_cb=errors.on_error,
            max_reconnect_attempts=-1,
            name=settings.holder_id,
            allow_reconnect=True,
        )
    )
    ended = asyncio.ensure_future(errors.ended.wait())
    try:
        await asyncio.wait({connecting, ended}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done() or connecting.cancelled() or connecting.exception() is not None:
            failure = None if not connecting.done() or connecting.cancelled() else connecting.exception()
            seen = errors.final or failure or errors.last
            raise start_error(settings.nats_url, seen, settings.connect_timeout_ms)
        router = DirectoryRouter(nc, tenant=settings.nats_tenant)
        await _check_access(settings.nats_url, nc, router, errors, deadline)
    except BaseException:
        # A client closed while starting closes its loop under this coroutine, which is then
        # finalized: cancelling on a closed loop raises RuntimeError (nothing can run any more).
        with contextlib.suppress(RuntimeError):
            connecting.cancel()
        with contextlib.suppress(BaseException):
            await connecting
        with contextlib.suppress(Exception):
            await nc.close()
        raise
    finally:
        with contextlib.suppress(RuntimeError):
            ended.cancel()
    errors.started = True
    return nc, router


async def _check_access(
    url: str, nc: NatsClient, router: DirectoryRouter, errors: NatsErrors, deadline: float
) -> None:
    """Ask for the shard map on the client's own subjects; `Unauthorized` when NATS refused them."""
    for step in (router.refresh, nc.flush):  # the server's -ERR comes before its PONG
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            break
        with contextlib.suppress(asyncio.TimeoutError, KvfError, nats.errors.Error):
            await asyncio.wait_for(step(), left_s)
    if errors.final is not None:
        raise start_error(url, errors.final, 0)

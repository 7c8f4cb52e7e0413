"""The tarpit's shell: a NATS connection that takes a flooding tenant's requests and never reads them.

`kvfabric.runtime.tarpit_core` decides which tenants are tarpitted (≥ `refusals_max` `busy`
answers within a second); this module makes the pace. While a tenant is tarpitted, a second
connection of the service (the *link*, a few lines of the NATS protocol: CONNECT, SUB, PING)
subscribes that tenant's work subjects (never its give-backs: releases, unpins and aborts go
on) in the service's queue group, `weight` times over. nats-server gives each request of a queue
group to one of the group's subscriptions at random, so the service's own (wildcard) endpoint
gets 1 in `weight + 1` of the tenant's requests and the link the rest — and the link never reads
its socket: those requests are never received, decoded or answered by the service, and their
senders wait out their own timeouts. nats-server buffers what the link does not read up to its
per-connection bound (`max_pending`, 64 MiB by default: past it, it gives the queue group's
requests to the other subscriptions, the service's own) or write deadline (10 s), then closes the
link as a slow consumer. So a link is replaced every `ROTATE_S` while it holds a tenant (its
unread requests dropped with it): a tenant who publishes without waiting for answers, at the
~45 MB/s nats-server's TLS takes on this host, fills 64 MiB in ~1.4 s (measured with a scratch
flood of 0.38 MB requests: past the bound the service received every one for the ~10 s until
the server closed the link). One that waits for its answers, as every client does, has at most
its requests in flight there.

What the link costs: one connection, `weight` subscriptions per work verb of each tarpitted
tenant, and nats-server's buffer for it (bounded as above); what the service reads from it is
bounded by asyncio's stream buffer (it pauses reading past 128 KiB). A link is replaced whole
(make before break) whenever the set of tarpitted tenants changes: the old link's unread
requests go with it. The link connects to the server the service's own connection uses (NATS
prefers queue subscribers on the publisher's server), with the service's credentials and TLS.

Bounds: one link at a time (two while one replaces the other), opened at most once per
`LINK_RETRY_S` after a failure, each step awaited with `LINK_TIMEOUT_S`; a link past
`LINK_AGE_S_MAX` is dropped when its replacement failed (it would fill nats-server's buffer for
it), so it lives at most `LINK_AGE_S_MAX` + `LINK_TIMEOUT_S` (a failed connect's bound); `run`
ends when cancelled and never raises for a link it could not open (a service's watched task: an
exception would stop the service).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import ParseResult

from kvfabric.cluster.natsauth import NatsAuth
from kvfabric.runtime.tarpit_core import TarpitCore

__all__ = ["LINK_TIMEOUT_S", "TarpitLink", "TenantTarpit", "open_link"]

LINK_TIMEOUT_S: Final = 5.0
LINK_RETRY_S: Final = 1.0
TICK_S: Final = 0.25  # how often the link is checked (a PING written: a closed link fails it)
ROTATE_S: Final = 1.0  # a link is replaced this often while it holds tenants (module docstring)
LINK_AGE_S_MAX: Final = 2 * ROTATE_S
WEIGHT_DEFAULT: Final = 63  # the service's endpoint gets 1 in 64 of a tarpitted tenant's requests


class LinkError(Exception):
    """The link could not be opened (refused, timed out, or an -ERR from the server)."""


@dataclass(slots=True)
class TarpitLink:
    tenants: frozenset[str]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    opened_s: float = 0.0  # on the tarpit's clock
    closed_seen: bool = False  # its close by the server was logged

    def alive(self) -> bool:
        return not self.writer.is_closing()

    def ping(self) -> None:
        """A PING written: a link the server closed fails its next write (closing the writer)."""
        if self.alive():
            with contextlib.suppress(ConnectionError, RuntimeError):
                self.writer.write(b"PING\r\n")

    async def close(self) -> None:
        """Dropped at once, unread requests and all: nothing of ours is worth flushing (a
        graceful TLS close also reads the peer's EOF, which asyncio warns about once a link)."""
        self.writer.transport.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), LINK_TIMEOUT_S)


async def _frame(reader: asyncio.StreamReader) -> bytes:
    """One protocol line; a message's payload skipped (requests that arrive before the PONG)."""
    line = await reader.readline()
    if not line:
        raise LinkError("the server closed the link")
    head = line.split()
    if head and head[0] in (b"MSG", b"HMSG"):
        await reader.readexactly(int(head[-1]) + 2)
    return line


def credentials(server: ParseResult, auth: NatsAuth) -> dict[str, str]:
    """CONNECT's credentials: those in the server URL (as nats-py takes them), else `auth`'s."""
    if server.username and server.password:
        return {"user": server.username, "pass": server.password}
    if server.username:
        return {"auth_token": server.username}
    if auth.user:
        return {"user": auth.user, "pass": auth.password}
    return {}


async def open_link(
    server: ParseResult,
    auth: NatsAuth,
    subjects: list[str],
    queue: str,
    *,
    weight: int,
    tenants: frozenset[str],
    name: str,
    tls: ssl.SSLContext | None = None,
    timeout_s: float = LINK_TIMEOUT_S,
) -> TarpitLink:
    """Connect, authenticate, subscribe `weight` times to each subject in `queue`, and see the
    server's PONG (so every SUB is in place). `tls`: the service's context (built once).
    Raises `LinkError`."""
    writer: asyncio.StreamWriter | None = None
    try:
        host, port = server.hostname or "127.0.0.1", server.port or 4222
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            info_line = await reader.readline()
            if not info_line.startswith(b"INFO "):
                raise LinkError(f"no INFO from the server: {info_line[:40]!r}")
            info = json.loads(info_line[5:])
            if not isinstance(info, dict):
                raise LinkError("the server's INFO is not an object")
            if info.get("tls_required") or tls is not None or server.scheme == "tls":
                await writer.start_tls(tls or ssl.create_default_context(), server_hostname=host)
            connect: dict[str, Any] = {
                "verbose": False,
                "pedantic": False,
                "lang": "python",
                "version": "kvf-tarpit",
                "protocol": 1,
                "name": name,
                "headers": True,
                "no_responders": True,
            }
            connect.update(credentials(server, auth))
            lines = [b"CONNECT " + json.dumps(connect).encode() + b"\r\n"]
            sid = 0
            for subject in subjects:
                for _ in range(weight):
                    sid += 1
                    lines.append(f"SUB {subject} {queue} {sid}\r\n".encode())
            lines.append(b"PING\r\n")
            writer.write(b"".join(lines))
            await writer.drain()
            while True:
                line = await _frame(reader)
                if line.startswith(b"-ERR"):
                    raise LinkError(line.decode(errors="replace").strip())
                if line.startswith(b"PONG"):
                    return TarpitLink(tenants=tenants, reader=reader, writer=writer)
                if line.startswith(b"PING"):
                    writer.write(b"PONG\r\n")
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, ssl.SSLError) as exc:
        if writer is not None:
            writer.transport.abort()
        raise LinkError(f"{type(exc).__name__}: {exc}") from exc
    except BaseException:
        if writer is not None:
            writer.transport.abort()
        raise


class TenantTarpit:
    """The tarpit of one service instance: `note_refusal` from its request path, `run` as a task."""

    def __init__(
        self,
        core: TarpitCore,
        *,
        subjects_for: Callable[[str], list[str]],
        queue: str,
        server: Callable[[], ParseResult | None],
        auth: NatsAuth,
        name: str,
        log: Any,
        tls: ssl.SSLContext | None = None,
        weight: int = WEIGHT_DEFAULT,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] = lambda: None,
        on_tarpitted: Callable[[str, float], None] = lambda tenant, seconds: None,
    ) -> None:
        self.core = core
        self._subjects_for = subjects_for
        self._queue = queue
        self._server = server
        self._auth = auth
        self._tls = tls
        self._on_change = on_change  # after every pass of `run` (the service's metrics)
        self._on_tarpitted = on_tarpitted  # (tenant, seconds) as it is tarpitted
        self._name = name
        self._log = log
        self.weight = weight
        self._clock = clock
        self._changed = asyncio.Event()
        self._link: TarpitLink | None = None
        self.links_opened_total = 0
        self.link_failures_total = 0

    @property
    def link_tenants(self) -> frozenset[str]:
        """The tenants the open link holds now (empty without one)."""
        link = self._link
        return link.tenants if link is not None and link.alive() else frozenset()

    def note_refusal(self, tenant: str) -> None:
        now_s = self._clock()
        if self.core.note_refusal(tenant, now_s):
            until = self.core.until_s(tenant) or now_s
            self._log.warning("tenant_tarpitted", tenant=tenant, seconds=round(until - now_s, 3))
            self._changed.set()
            self._on_change()
            self._on_tarpitted(tenant, until - now_s)

    async def run(self) -> None:
        """Keep the link holding exactly the tarpitted tenants, until cancelled."""
        try:
            while True:
                self._changed.clear()  # before `want`: a tenant tarpitted from here on wakes the wait
                for tenant in self.core.expire(self._clock()):
                    self._log.info("tenant_tarpit_ended", tenant=tenant)
                want = self.core.tarpitted()
                link = self._link
                if link is not None and not want:
                    self._link = None
                    await link.close()
                elif link is not None and not link.alive() and not link.closed_seen:
                    link.closed_seen = True
                    self._log.info("tarpit_link_closed_by_server", tenants=sorted(link.tenants))
                if want and self._needs_new_link(want):
                    await self._replace(want)
                link = self._link
                if link is not None and self._clock() - link.opened_s > LINK_AGE_S_MAX:
                    self._link = None  # its replacement failed: not kept to fill the server's buffer
                    await link.close()
                if self._link is not None:
                    self._link.ping()
                self._on_change()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._wait_s()):
                        await self._changed.wait()
        finally:
            link, self._link = self._link, None
            if link is not None:
                await link.close()

    def _needs_new_link(self, want: frozenset[str]) -> bool:
        link = self._link
        if link is None or not link.alive() or link.tenants != want:
            return True
        return self._clock() - link.opened_s >= ROTATE_S

    def _wait_s(self) -> float:
        expiry = self.core.next_expiry_s()
        if expiry is None:
            return TICK_S if self._link is not None else 3600.0
        return max(0.0, min(TICK_S, expiry - self._clock()))

    async def _replace(self, want: frozenset[str]) -> None:
        """A new link for `want`, then the old one closed (make before break)."""
        server = self._server()
        if server is None:
            await asyncio.sleep(LINK_RETRY_S)
            return
        subjects = [s for tenant in sorted(want) for s in self._subjects_for(tenant)]
        try:
            new = await open_link(
                server,
                self._auth,
                subjects,
                self._queue,
                weight=self.weight,
                tenants=want,
                name=self._name,
                tls=self._tls,
            )
        except Exception as exc:  # any: a watched task's exception would stop the service
            self.link_failures_total += 1
            self._log.warning(
                "tarpit_link_failed", error=f"{type(exc).__name__}: {exc}", tenants=sorted(want)
            )
            old = self._link
            if old is not None and self._clock() - old.opened_s > LINK_AGE_S_MAX:
                self._link = None  # not kept past its age to fill the server's buffer meanwhile
                await old.close()
            await asyncio.sleep(LINK_RETRY_S)
            return
        new.opened_s = self._clock()
        old, self._link = self._link, new
        self.links_opened_total += 1
        if old is not None:
            await old.close()

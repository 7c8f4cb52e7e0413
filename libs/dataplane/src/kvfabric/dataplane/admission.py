"""Who may hold a data-plane connection, and for how long (pure: no I/O, time passed in).

A segment's data port is reachable by anyone on its network, and the only credentials a peer can
hold are the directory's: a read token for a replica on this segment, or a write ticket for it.
So every connection starts **unauthenticated** and has `auth_deadline_ms` from its accept to
present one (in its first request: a PUT's ticket, a GET's / PIN_LOCAL's read tokens, a MAP's
credential); otherwise it is closed. The transports (`kvfabric.dataplane.tcp`, `.ucx`) ask the
backend whether a request's credential is valid (`Authenticator`) and ask a `ConnectionGate`
whether the connection may exist.

States of a connection: unauthenticated -> authenticated -> closed (any state may close).

Bounds (`ConnectionLimits`, each with its unit):
- unauthenticated connections: at most `unauthenticated_max`, and `unauthenticated_per_source_max`
  per peer address. A new connection past either bound **closes the oldest unauthenticated one**
  (of that source when the source's bound is the one reached) instead of being refused: an
  unauthenticated connection holds nothing and may do nothing, and a token holder authenticates
  with its first frame, microseconds after connecting, so it is never the oldest for long. A flood
  of idle or trickling connections therefore takes no slot a token holder needs.
- authenticated connections: at most `connections_max`, and `connections_per_source_max` per peer
  address. Past either bound the connection is refused (`Busy`) when it authenticates.
- deadlines are absolute, never reset by a byte (a trickle cannot extend them):
  - unauthenticated: `auth_deadline_ms` after the accept, whatever arrives meanwhile (a TLS
    handshake, a frame sent a byte at a time);
  - authenticated, between requests: `idle_timeout_ms` after the end of the last request that
    presented a credential the backend accepted: a PUT whose ticket `begin_put` took, a GET or
    PIN_LOCAL one of whose reads passed its token check (`reads_credited`: from the statuses the
    backend computes anyway, no MAC more on the GET path), a MAP whose credential `authenticate`
    accepts (the connection's first request, admitted, is one). Any other request (UNPIN_LOCAL,
    still served: give-backs are never refused; a MAP, GET or PIN_LOCAL whose credentials all
    failed; a refused PUT) extends nothing: one token held once kept a connection, and its place
    among `connections_max`, open for good by a MAP or an empty UNPIN_LOCAL every 299 s (found in
    review). A request begun before that deadline may end after it (under its own deadlines);
    the connection is then closed before another is read, so a peer that keeps its next request
    always queued gains at most one request's time. Without an `authenticate` (no credentials in
    the deployment) every request renews it;
  - a request: header and meta within `frame_timeout_ms` of its first byte; a payload (a PUT's
    bytes, a GET's reply) within `transfer_ms(size)`: `frame_timeout_ms` plus its size at
    `transfer_rate_min_bytes_per_s`.

Invariants: the gate holds one entry per open connection and nothing per frame; a connection it
does not know (closed, or evicted) is never authenticated; counts per source are dropped when
they reach zero (no entry per address ever seen).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final, Protocol

from kvfabric.format.errors import Busy, KvfError, Unavailable

__all__ = [
    "AUTH_DEADLINE_MS_DEFAULT",
    "CONNECTIONS_MAX_DEFAULT",
    "CONNECTIONS_PER_SOURCE_MAX_DEFAULT",
    "FRAME_TIMEOUT_MS_DEFAULT",
    "IDLE_TIMEOUT_MS_DEFAULT",
    "TRANSFER_RATE_MIN_BYTES_PER_S_DEFAULT",
    "UNAUTHENTICATED_MAX_DEFAULT",
    "UNAUTHENTICATED_META_BYTES_MAX",
    "UNAUTHENTICATED_PER_SOURCE_MAX_DEFAULT",
    "UNCREDITED_STATUSES",
    "Authenticator",
    "ConnectionGate",
    "ConnectionLimits",
    "reads_credited",
]

CONNECTIONS_MAX_DEFAULT: Final = 64  # authenticated connections at once
CONNECTIONS_PER_SOURCE_MAX_DEFAULT: Final = 32  # authenticated connections from one peer address
# Connections that have not presented a credential yet, and of those from one peer address. Room
# for a burst of honest connects from one host (a client pool opens up to 8 at once per process)
# that are all still unauthenticated: they authenticate within about a millisecond, so a flood
# must open more than this many connections in that time to evict one.
UNAUTHENTICATED_MAX_DEFAULT: Final = 64
UNAUTHENTICATED_PER_SOURCE_MAX_DEFAULT: Final = 16
AUTH_DEADLINE_MS_DEFAULT: Final = 1_000  # from accept to an accepted credential
IDLE_TIMEOUT_MS_DEFAULT: Final = 300_000  # an authenticated connection between requests
FRAME_TIMEOUT_MS_DEFAULT: Final = 10_000  # a request's header + meta, from its first byte
TRANSFER_RATE_MIN_BYTES_PER_S_DEFAULT: Final = 1 << 20  # a payload slower than this is cut off
# The first frame's meta is read before its credential is checked: bounded below META_BYTES_MAX
# (a GET of READS_MAX references with tokens is ~215 KB).
UNAUTHENTICATED_META_BYTES_MAX: Final = 256 << 10
# A read's status that says its token was not accepted (failed, expired, or of another
# incarnation); any other (`ok`, and `not_found`, `stale_generation`, `wrong_size`: looked up,
# so past the token check) says it was, where the backend checks read tokens.
UNCREDITED_STATUSES: Final = frozenset({"unauthorized", "stale_incarnation"})


def reads_credited(statuses: Iterable[str]) -> bool:
    """Whether a GET's or PIN_LOCAL's answer shows one of its read tokens accepted by the backend
    (it renews the connection's idle deadline). A backend that checks no read tokens
    (`read_tokens_required` off) answers no read `unauthorized`: then any read looked up counts."""
    return any(status not in UNCREDITED_STATUSES for status in statuses)


class Authenticator(Protocol):
    """True when a decoded request meta carries a credential valid for this segment now (a
    signed, unexpired write ticket for it, or a read reference with a valid, unexpired token).
    Pure and cheap (a MAC or two); it must keep no state per call."""

    def __call__(self, meta: object) -> bool: ...


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    connections_max: int = CONNECTIONS_MAX_DEFAULT
    connections_per_source_max: int = CONNECTIONS_PER_SOURCE_MAX_DEFAULT
    unauthenticated_max: int = UNAUTHENTICATED_MAX_DEFAULT
    unauthenticated_per_source_max: int = UNAUTHENTICATED_PER_SOURCE_MAX_DEFAULT
    auth_deadline_ms: int = AUTH_DEADLINE_MS_DEFAULT
    idle_timeout_ms: int = IDLE_TIMEOUT_MS_DEFAULT
    frame_timeout_ms: int = FRAME_TIMEOUT_MS_DEFAULT
    transfer_rate_min_bytes_per_s: int = TRANSFER_RATE_MIN_BYTES_PER_S_DEFAULT

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def transfer_ms(self, size_bytes: int) -> int:
        """How long a payload of `size_bytes` may take, overall."""
        return self.frame_timeout_ms + math.ceil(
            max(size_bytes, 0) * 1000 / self.transfer_rate_min_bytes_per_s
        )


@dataclass(slots=True)
class _Entry:
    source: str
    authenticated: bool = False


@dataclass
class ConnectionGate:
    """Admission of one transport's connections (the caller serialises calls: one lock)."""

    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    # Insertion-ordered: the first unauthenticated entry is the oldest.
    _unauthenticated: dict[int, _Entry] = field(default_factory=dict)
    _authenticated: dict[int, _Entry] = field(default_factory=dict)
    _unauthenticated_by_source: Counter[str] = field(default_factory=Counter)
    _authenticated_by_source: Counter[str] = field(default_factory=Counter)
    counters: dict[str, int] = field(default_factory=dict)
    # Also told each event (the segment exports them as `kvfabric_segment_events_total`).
    on_event: Callable[[str], None] | None = None

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1
        if self.on_event is not None:
            self.on_event(name)

    @property
    def unauthenticated(self) -> int:
        return len(self._unauthenticated)

    @property
    def authenticated(self) -> int:
        return len(self._authenticated)

    def open(self, conn: int, source: str) -> list[int]:
        """Admit `conn` (from peer address `source`) as unauthenticated. Returns the connections
        to close now to make room (the oldest unauthenticated ones): they are already forgotten
        here, so they can no longer authenticate."""
        if conn in self._unauthenticated or conn in self._authenticated:
            raise ValueError(f"connection {conn} is already open")
        evicted: list[int] = []
        if self._unauthenticated_by_source[source] >= self.limits.unauthenticated_per_source_max:
            evicted.append(next(c for c, e in self._unauthenticated.items() if e.source == source))
            self._forget(evicted[-1])
        if len(self._unauthenticated) >= self.limits.unauthenticated_max:
            evicted.append(next(iter(self._unauthenticated)))
            self._forget(evicted[-1])
        for _ in evicted:
            self._count("unauthenticated_evicted_total")
        self._unauthenticated[conn] = _Entry(source)
        self._unauthenticated_by_source[source] += 1
        return evicted

    def authenticate(self, conn: int) -> KvfError | None:
        """`conn` presented a valid credential: it becomes authenticated, or the error to answer
        before closing it (`Busy` past an authenticated bound; `Unavailable` when it was closed
        or evicted meanwhile). On an error the connection stays counted until `close`."""
        entry = self._unauthenticated.get(conn)
        if entry is None:
            return Unavailable("the data connection was closed (it waited too long to authenticate)")
        if len(self._authenticated) >= self.limits.connections_max:
            self._count("busy_total")
            return Busy("too many data connections", limit=self.limits.connections_max)
        if self._authenticated_by_source[entry.source] >= self.limits.connections_per_source_max:
            self._count("busy_source_total")
            return Busy(
                "too many data connections from this address",
                limit=self.limits.connections_per_source_max,
            )
        self._forget(conn)
        entry.authenticated = True
        self._authenticated[conn] = entry
        self._authenticated_by_source[entry.source] += 1
        self._count("authenticated_total")
        return None

    def close(self, conn: int) -> None:
        """`conn` closed (for whatever reason); unknown connections are ignored."""
        self._forget(conn)

    def _forget(self, conn: int) -> None:
        for table, by_source in (
            (self._unauthenticated, self._unauthenticated_by_source),
            (self._authenticated, self._authenticated_by_source),
        ):
            entry = table.pop(conn, None)
            if entry is not None:
                by_source[entry.source] -= 1
                if by_source[entry.source] <= 0:
                    del by_source[entry.source]

"""How a process authenticates to NATS: user + password and, by config, TLS.

Every kvfabric process reads the same variables (services and kvctl directly; the client lib
through `KVF_CLIENT_NATS_*`, see `kvfabric.client.settings`):

| variable | meaning |
|---|---|
| `KVF_NATS_USER` | NATS user name (one per service kind and per tenant, from `kvctl auth init`) |
| `KVF_NATS_PASSWORD_FILE` | file holding the password (preferred: keeps it out of `ps` and env dumps) |
| `KVF_NATS_PASSWORD` | the password itself (when no file is given) |
| `KVF_NATS_TLS_CA` | CA bundle: connect with TLS and verify the server against it |
| `KVF_NATS_TLS_CERT`, `KVF_NATS_TLS_KEY` | client certificate and key (servers that verify clients) |

Unset: no credentials, plain TCP (a development server without authorization).
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import nats.errors

__all__ = [
    "NATS_ENV_PREFIX",
    "NatsAuth",
    "describe_nats_error",
    "is_nats_refusal",
    "nats_auth_from_env",
    "nats_servers",
    "nats_servers_problem",
    "servers_without_userinfo",
    "url_without_userinfo",
]

NATS_ENV_PREFIX: Final = "KVF_NATS_"
# Server answers that another attempt cannot change (nats-py reports them as `nats.errors.Error`):
# nats-server's refusals of credentials or permissions, and their expiry or revocation.
_REFUSALS: Final = (
    "authorization violation",
    "permissions violation",
    "authentication expired",
    "authentication revoked",
)
# ... but not "Authentication Timeout": the server's answer to a CONNECT that came after its
# auth_timeout (a busy host, a slow TLS handshake), which another attempt may pass. It was taken
# for refused credentials: the client gave up at once, disabled (review, stop 68).


def is_nats_refusal(exc: BaseException) -> bool:
    """Whether `exc` is the server refusing this connection's credentials or permissions."""
    return isinstance(exc, nats.errors.Error) and any(r in str(exc).lower() for r in _REFUSALS)


def describe_nats_error(exc: BaseException) -> str:
    """A connect error for a message: nats-py's own text, or the error's type and text."""
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, nats.errors.Error) else f"{type(exc).__name__}: {text}"


_URL_SCHEME: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# Between the URLs of a cluster's servers: a comma before the next URL's scheme (a comma inside
# a password, not URL-escaped, is no separator: it is followed by no "scheme://").
_SERVERS_SEPARATOR: Final = re.compile(r",\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def nats_servers(url: str) -> list[str]:
    """The server URLs of a NATS setting: one URL, or a comma list of URLs, each with its scheme
    (`nats://a:4222,nats://b:4222`): the servers of one NATS cluster, any of which a connection
    may use and fail over to (nats-py's server pool). Elements stripped; an empty one stays
    empty for the caller's check to refuse."""
    return [part.strip() for part in _SERVERS_SEPARATOR.split(url)]


NATS_URL_SCHEMES: Final = ("nats", "tls", "ws", "wss")


def nats_servers_problem(url: str) -> str | None:
    """What is wrong with a NATS setting (`nats_servers`), None if nothing: an empty element, a
    scheme nats-py does not speak, two URLs run together, websocket and other URLs mixed (which
    nats-py refuses when it connects: a setting error, not an unreachable cluster)."""
    servers = nats_servers(url)
    for server in servers:
        scheme, sep, rest = server.partition("://")
        if not server or (sep and scheme not in NATS_URL_SCHEMES) or "://" in rest:
            return (
                f"{url_without_userinfo(server)[0]!r} is not nats://host:port (or tls://, ws://, wss://;"
                " several servers of one cluster: a comma list of them)"
            )
    if len({server.partition("://")[0] in ("ws", "wss") for server in servers if "://" in server}) > 1:
        return "it mixes websocket and other URLs"
    return None


def servers_without_userinfo(url: str) -> str:
    """`url` (one URL or a comma list, `nats_servers`) for a message: every element without its
    credentials (`url_without_userinfo`)."""
    return ",".join(url_without_userinfo(part)[0] for part in nats_servers(url))


def url_without_userinfo(url: str) -> tuple[str, str, bool]:
    """`url` without the `user:password@` (or `token@`) of its authority, that user ("" if
    none) and whether the URL carries credentials: messages never print a password or a token
    (nats-py sends a URL's user without a password as a token)."""
    scheme, sep, rest = url.partition("://")
    if sep and _URL_SCHEME.fullmatch(scheme):
        # The authority ends at the first "/", "?" or "#" after its last "@": a password not
        # URL-escaped may hold those characters, and cutting at the first one left it in the
        # message (review, 2026-12-05).
        start = rest.rfind("@") + 1
        ends = (rest.find(c, start) for c in "/?#")
        cut = min((i for i in ends if i >= 0), default=len(rest))
        authority, path = rest[:cut], rest[cut:]
        prefix = scheme + sep
    else:  # no scheme (or a password with "://" in it): everything up to the last "@"
        authority, path, prefix = url, "", ""
    userinfo, at, host = authority.rpartition("@")
    if not at:
        return url, "", False
    user, colon, _ = userinfo.partition(":")
    return f"{prefix}{host}{path}", user if colon else "", True


@dataclass(frozen=True, slots=True)
class NatsAuth:
    user: str = ""
    password: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    inbox_prefix: str = ""  # a tenant's replies arrive only under its own prefix

    def __repr__(self) -> str:  # never print the password
        return f"NatsAuth(user={self.user!r}, tls={bool(self.tls_ca)}, inbox_prefix={self.inbox_prefix!r})"

    def tls_context(self) -> ssl.SSLContext | None:
        if not self.tls_ca:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        if self.tls_cert:
            context.load_cert_chain(self.tls_cert, self.tls_key or None)
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect`."""
        options: dict[str, Any] = {}
        if self.user:
            options["user"] = self.user
            options["password"] = self.password
        context = self.tls_context()
        if context is not None:
            options["tls"] = context
        if self.inbox_prefix:
            options["inbox_prefix"] = self.inbox_prefix
        return options


def nats_auth_from_env(environ: Mapping[str, str], prefix: str = NATS_ENV_PREFIX) -> NatsAuth:
    """`NatsAuth` from `<prefix>USER`, `<prefix>PASSWORD_FILE` / `<prefix>PASSWORD`, `<prefix>TLS_*`."""
    password = environ.get(prefix + "PASSWORD", "")
    password_file = environ.get(prefix + "PASSWORD_FILE", "")
    if password_file:
        password = Path(password_file).read_text().strip()
    return NatsAuth(
        user=environ.get(prefix + "USER", ""),
        password=password,
        tls_ca=environ.get(prefix + "TLS_CA", ""),
        tls_cert=environ.get(prefix + "TLS_CERT", ""),
        tls_key=environ.get(prefix + "TLS_KEY", ""),
    )

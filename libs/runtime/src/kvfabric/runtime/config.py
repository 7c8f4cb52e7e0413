"""Settings every service runtime shares, from flags with `KVF_<NAME>` environment fallbacks.

Precedence, per field: command-line flag, then environment variable `KVF_<FIELD>` (upper case,
e.g. `KVF_NATS_URL`, `KVF_INFLIGHT_MAX`), then the default here. `load_settings` does the merge,
so flags (typer, see `kvfabric.runtime.cli`) and env are parsed by one piece of code.

Invalid values are operating errors (a bad deploy), raised as `SettingsError` with the name of
the flag and of the env var, and turned into a usage error (exit code 2) by the CLI.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from kvfabric.cluster.natsauth import nats_servers_problem, servers_without_userinfo
from kvfabric.format.invariant import invariant

__all__ = [
    "ENV_PREFIX",
    "INFLIGHT_MAX_DEFAULT",
    "LOG_LEVELS",
    "LOG_SLOW_REQUEST_MS_DEFAULT",
    "METRICS_PORT_DISABLED",
    "METRICS_PORT_PICK_FREE",
    "NATS_URL_DEFAULT",
    "STOP_DEADLINE_MS_DEFAULT",
    "RuntimeSettings",
    "SettingsError",
    "env_int",
    "env_name",
    "load_settings",
    "new_instance_id",
]

ENV_PREFIX: Final = "KVF_"
NATS_URL_DEFAULT: Final = "nats://127.0.0.1:4222"
METRICS_PORT_PICK_FREE: Final = 0
METRICS_PORT_DISABLED: Final = -1
INFLIGHT_MAX_DEFAULT: Final = 64
INFLIGHT_MAX_LIMIT: Final = 100_000
SHUTDOWN_GRACE_MS_DEFAULT: Final = 5_000
SHUTDOWN_GRACE_MS_MAX: Final = 600_000
# A requested stop (SIGTERM, a lapsed lease, NATS lost) that has not ended the process by then
# exits it (`kvfabric.runtime.deadline`): below Kubernetes' 30 s, and above the stop's usual
# steps (5 s each: endpoints, in-flight grace, cancelled handlers, NATS drain). Each step is
# bounded, but not all together: the tarpit's stop and the held refusals' answers can add up to
# 5 s each, so a stop whose every step runs to its bound is cut here (exit 79) and restarted.
STOP_DEADLINE_MS_DEFAULT: Final = 25_000
STOP_DEADLINE_MS_MAX: Final = 3_600_000
# A request that took this long (its reply pad excluded) is logged at warning level; others
# at debug (issue 21: one info line per request was 188 MB in 45 min on one directory).
LOG_SLOW_REQUEST_MS_DEFAULT: Final = 100
NATS_CONNECT_TIMEOUT_MS_DEFAULT: Final = 2_000
NATS_RECONNECT_WAIT_MS_DEFAULT: Final = 500
NATS_RECONNECT_ATTEMPTS_MAX_DEFAULT: Final = 120
NATS_RECONNECT_ATTEMPTS_LIMIT: Final = 100_000
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
# What an instance subject takes (kvfabric.proto.subjects: a letter or digit first): "_dir0" passed
# here and the directory died at start, connected and electing, with a traceback (review, stop 68).
_INSTANCE_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})
_AUTO: Final = frozenset({"", "auto"})


class SettingsError(ValueError):
    """A setting has an invalid value. The message names the flag and the env var."""


def new_instance_id() -> str:
    """A random instance id: 12 hex chars, unique enough within one cluster."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    """What the runtime needs to run one service instance. Validated on construction."""

    nats_url: str = NATS_URL_DEFAULT
    instance_id: str = field(default_factory=new_instance_id)
    # 0: pick a free port (the bound one is logged and exposed); -1: no metrics server.
    metrics_port: int = METRICS_PORT_PICK_FREE
    metrics_host: str = "127.0.0.1"
    # Handlers running at once; one more request is answered `Busy` at once, never queued.
    inflight_max: int = INFLIGHT_MAX_DEFAULT
    log_level: str = "info"
    # None: JSON when stderr is not a TTY, console rendering on one.
    log_json: bool | None = None
    # On SIGTERM/SIGINT: how long in-flight handlers may finish before they are cancelled.
    shutdown_grace_ms: int = SHUTDOWN_GRACE_MS_DEFAULT
    # After a stop is requested, the process exits (code 79) by this deadline whatever hangs.
    stop_deadline_ms: int = STOP_DEADLINE_MS_DEFAULT
    # Requests at least this slow are logged at warning level; the rest at debug (errors: always).
    log_slow_request_ms: int = LOG_SLOW_REQUEST_MS_DEFAULT
    nats_connect_timeout_ms: int = NATS_CONNECT_TIMEOUT_MS_DEFAULT
    nats_reconnect_wait_ms: int = NATS_RECONNECT_WAIT_MS_DEFAULT
    # Per server; after that the connection closes and the service exits non-zero.
    nats_reconnect_attempts_max: int = NATS_RECONNECT_ATTEMPTS_MAX_DEFAULT

    def __post_init__(self) -> None:
        problem = nats_servers_problem(self.nats_url) if self.nats_url.strip() else "must not be empty"
        # (a setting error, said at start: nats-py's own error was reported `Unavailable` and a
        # supervisor restarted the service for good; the URL printed without its password)
        _check(problem is None, "nats_url", servers_without_userinfo(self.nats_url), problem or "")
        _check(
            _INSTANCE_ID.fullmatch(self.instance_id) is not None,
            "instance_id",
            self.instance_id,
            "want 1-64 chars of [A-Za-z0-9_-], a letter or digit first",
        )
        _check(-1 <= self.metrics_port <= 65535, "metrics_port", self.metrics_port, "want -1..65535")
        _check(bool(self.metrics_host.strip()), "metrics_host", self.metrics_host, "must not be empty")
        _check(
            1 <= self.inflight_max <= INFLIGHT_MAX_LIMIT,
            "inflight_max",
            self.inflight_max,
            f"want 1..{INFLIGHT_MAX_LIMIT}",
        )
        _check(self.log_level in LOG_LEVELS, "log_level", self.log_level, f"want one of {LOG_LEVELS}")
        _check(
            0 <= self.shutdown_grace_ms <= SHUTDOWN_GRACE_MS_MAX,
            "shutdown_grace_ms",
            self.shutdown_grace_ms,
            f"want 0..{SHUTDOWN_GRACE_MS_MAX}",
        )
        _check(
            self.shutdown_grace_ms < self.stop_deadline_ms <= STOP_DEADLINE_MS_MAX,
            "stop_deadline_ms",
            self.stop_deadline_ms,
            f"want more than shutdown_grace_ms ({self.shutdown_grace_ms}) and at most {STOP_DEADLINE_MS_MAX}",
        )
        _check(self.log_slow_request_ms >= 0, "log_slow_request_ms", self.log_slow_request_ms, "want >= 0")
        _check(
            1 <= self.nats_connect_timeout_ms <= 600_000,
            "nats_connect_timeout_ms",
            self.nats_connect_timeout_ms,
            "want 1..600000",
        )
        _check(
            # 0 let the bounded reconnects burn out in milliseconds: a sub-second NATS blip then
            # stopped every service (review, 2026-12-05)
            10 <= self.nats_reconnect_wait_ms <= 600_000,
            "nats_reconnect_wait_ms",
            self.nats_reconnect_wait_ms,
            "want 10..600000",
        )
        _check(
            1 <= self.nats_reconnect_attempts_max <= NATS_RECONNECT_ATTEMPTS_LIMIT,
            "nats_reconnect_attempts_max",
            self.nats_reconnect_attempts_max,
            f"want 1..{NATS_RECONNECT_ATTEMPTS_LIMIT} (reconnects are bounded)",
        )

    @property
    def metrics_enabled(self) -> bool:
        return self.metrics_port != METRICS_PORT_DISABLED


def env_int(environ: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    """An integer service setting from the environment variable `name` (unset or empty: `default`).
    Raises `SettingsError` naming the variable when it is not an integer in `lo..hi`."""
    raw = environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: not an integer") from None
    if not lo <= value <= hi:
        raise SettingsError(f"{name}={value}: want {lo}..{hi}")
    return value


def env_name(field_name: str) -> str:
    """`nats_url` -> `KVF_NATS_URL`."""
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    """`nats_url` -> `--nats-url`."""
    return "--" + field_name.replace("_", "-")


# Read from the environment only: `kvfabric.runtime.cli` has no flag for them.
_ENV_ONLY: Final = frozenset(
    {"nats_connect_timeout_ms", "nats_reconnect_wait_ms", "nats_reconnect_attempts_max"}
)


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        where = env_name(name) if name in _ENV_ONLY else f"{flag_name(name)} / {env_name(name)}"
        raise SettingsError(f"invalid {name} {value!r} ({where}): {why}")


def _parse_int(name: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise SettingsError(f"invalid {env_name(name)}={text!r}: want an integer") from None


def _parse_str(name: str, text: str) -> str:
    return text.strip()


def _parse_level(name: str, text: str) -> str:
    return text.strip().lower()


def _parse_optional_bool(name: str, text: str) -> bool | None:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    if value in _AUTO:
        return None
    raise SettingsError(f"invalid {env_name(name)}={text!r}: want true, false or auto")


_PARSERS: Final[Mapping[str, Callable[[str, str], object]]] = {
    "nats_url": _parse_str,
    "instance_id": _parse_str,
    "metrics_port": _parse_int,
    "metrics_host": _parse_str,
    "inflight_max": _parse_int,
    "log_level": _parse_level,
    "log_json": _parse_optional_bool,
    "shutdown_grace_ms": _parse_int,
    "stop_deadline_ms": _parse_int,
    "log_slow_request_ms": _parse_int,
    "nats_connect_timeout_ms": _parse_int,
    "nats_reconnect_wait_ms": _parse_int,
    "nats_reconnect_attempts_max": _parse_int,
}


invariant(
    set(_PARSERS) == {f.name for f in dataclasses.fields(RuntimeSettings)},
    "every RuntimeSettings field needs an env parser",
)


def load_settings(flags: Mapping[str, object], environ: Mapping[str, str]) -> RuntimeSettings:
    """Merge flags (a `None` value means "not given") over `KVF_*` env vars over defaults.

    Raises `SettingsError` on an unknown flag name or an invalid value.
    """
    names = {f.name for f in dataclasses.fields(RuntimeSettings)}
    unknown = sorted(set(flags) - names)
    if unknown:
        raise SettingsError(f"unknown settings {unknown}; known: {sorted(names)}")
    values: dict[str, object] = {}
    for name in names:
        flag_value = flags.get(name)
        if flag_value is not None:
            values[name] = flag_value
            continue
        env_value = environ.get(env_name(name))
        if env_value is None:
            continue
        parsed = _PARSERS[name](name, env_value)
        if parsed is not None:
            values[name] = parsed
    try:
        return RuntimeSettings(**values)  # type: ignore[arg-type]  # values are typed by _PARSERS
    except TypeError as exc:
        raise SettingsError(f"invalid settings: {exc}") from exc

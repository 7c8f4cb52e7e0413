"""The command line every service shares: runtime flags with `KVF_*` env fallbacks.

`service_cli(name=..., help=..., main=...)` builds a typer app whose single command parses the
flags below, merges them over the environment (`load_settings`), configures logging and runs
`main(settings)` under `asyncio.run`, exiting with its return code (2 on a bad setting). Before
`main` runs, the process gets the services' garbage-collector policy (`kvfabric.runtime.gcpolicy`).

A service with flags of its own writes its own typer command with these `*Option` aliases plus
its own, and calls `load_settings` itself.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, TypeAlias

import typer

from kvfabric.runtime import gcpolicy
from kvfabric.runtime.config import (
    INFLIGHT_MAX_DEFAULT,
    LOG_SLOW_REQUEST_MS_DEFAULT,
    NATS_URL_DEFAULT,
    SHUTDOWN_GRACE_MS_DEFAULT,
    STOP_DEADLINE_MS_DEFAULT,
    RuntimeSettings,
    SettingsError,
    load_settings,
)
from kvfabric.runtime.logs import configure_logging

__all__ = [
    "InflightMaxOption",
    "InstanceIdOption",
    "LogJsonOption",
    "LogLevelOption",
    "LogSlowRequestMsOption",
    "MetricsHostOption",
    "MetricsPortOption",
    "NatsUrlOption",
    "ShutdownGraceMsOption",
    "StopDeadlineMsOption",
    "service_cli",
]

NatsUrlOption: TypeAlias = Annotated[
    str | None, typer.Option("--nats-url", help=f"NATS URL. Env KVF_NATS_URL. Default {NATS_URL_DEFAULT}.")
]
InstanceIdOption: TypeAlias = Annotated[
    str | None, typer.Option("--instance-id", help="Instance id. Env KVF_INSTANCE_ID. Default: random.")
]
MetricsPortOption: TypeAlias = Annotated[
    int | None,
    typer.Option(
        "--metrics-port", help="/metrics port; 0 picks a free one, -1 disables. Env KVF_METRICS_PORT."
    ),
]
MetricsHostOption: TypeAlias = Annotated[
    str | None,
    typer.Option("--metrics-host", help="/metrics bind address. Env KVF_METRICS_HOST. Default 127.0.0.1."),
]
InflightMaxOption: TypeAlias = Annotated[
    int | None,
    typer.Option(
        "--inflight-max",
        help=f"Handlers running at once; more are answered Busy. Env KVF_INFLIGHT_MAX. "
        f"Default {INFLIGHT_MAX_DEFAULT}.",
    ),
]
LogLevelOption: TypeAlias = Annotated[
    str | None, typer.Option("--log-level", help="debug|info|warning|error|critical. Env KVF_LOG_LEVEL.")
]
LogJsonOption: TypeAlias = Annotated[
    bool | None,
    typer.Option(
        "--log-json/--no-log-json",
        help="JSON log lines. Env KVF_LOG_JSON=true|false|auto. Default: JSON off a TTY.",
    ),
]
ShutdownGraceMsOption: TypeAlias = Annotated[
    int | None,
    typer.Option(
        "--shutdown-grace-ms",
        help=f"On SIGTERM, time in-flight requests get. Env KVF_SHUTDOWN_GRACE_MS. "
        f"Default {SHUTDOWN_GRACE_MS_DEFAULT}.",
    ),
]
StopDeadlineMsOption: TypeAlias = Annotated[
    int | None,
    typer.Option(
        "--stop-deadline-ms",
        help=f"After a stop is requested (SIGTERM, lease lost, NATS lost), exit with 79 by then "
        f"whatever hangs; a second SIGTERM exits at once. Env KVF_STOP_DEADLINE_MS. "
        f"Default {STOP_DEADLINE_MS_DEFAULT}.",
    ),
]
LogSlowRequestMsOption: TypeAlias = Annotated[
    int | None,
    typer.Option(
        "--log-slow-request-ms",
        help=f"Requests this slow are logged (warning); others at debug level; errors always. "
        f"Env KVF_LOG_SLOW_REQUEST_MS. Default {LOG_SLOW_REQUEST_MS_DEFAULT}.",
    ),
]


def service_cli(
    *, name: str, help: str, main: Callable[[RuntimeSettings], Coroutine[Any, Any, int]]
) -> typer.Typer:
    """A typer app running `main(settings)`; see the module docstring."""
    app = typer.Typer(name=name, help=help, add_completion=False, pretty_exceptions_enable=False)

    @app.command(name=name, help=help)
    def command(
        nats_url: NatsUrlOption = None,
        instance_id: InstanceIdOption = None,
        metrics_port: MetricsPortOption = None,
        metrics_host: MetricsHostOption = None,
        inflight_max: InflightMaxOption = None,
        log_level: LogLevelOption = None,
        log_json: LogJsonOption = None,
        shutdown_grace_ms: ShutdownGraceMsOption = None,
        stop_deadline_ms: StopDeadlineMsOption = None,
        log_slow_request_ms: LogSlowRequestMsOption = None,
    ) -> None:
        flags: dict[str, object] = {
            "nats_url": nats_url,
            "instance_id": instance_id,
            "metrics_port": metrics_port,
            "metrics_host": metrics_host,
            "inflight_max": inflight_max,
            "log_level": log_level.lower() if log_level is not None else None,
            "log_json": log_json,
            "shutdown_grace_ms": shutdown_grace_ms,
            "stop_deadline_ms": stop_deadline_ms,
            "log_slow_request_ms": log_slow_request_ms,
        }
        try:
            settings = load_settings(flags, os.environ)
        except SettingsError as exc:
            raise typer.BadParameter(str(exc)) from exc
        configure_logging(level=settings.log_level, json=settings.log_json)
        gcpolicy.install()
        raise typer.Exit(asyncio.run(main(settings)))

    return app

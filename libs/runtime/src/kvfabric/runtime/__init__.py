"""Service runtime (server side only): settings, logging, metrics, `nats.micro` registration.

- `config`: `RuntimeSettings`, `load_settings` (flags over `KVF_*` env over defaults).
- `cli`: `service_cli`, the typer command every service shares.
- `logs`: structlog setup, per-request context (`subject`, `request_id`, `trace_id`).
- `metrics`: `ServiceMetrics` on a per-runtime registry, `MetricsServer` for `/metrics`.
- `inflight`: `InflightLimiter`, the bounded in-flight count (answer `Busy`, never queue).
- `replies`: `KvfError` → ADR-32 service-error headers + `ErrorReply` body.
- `service`: `ServiceRuntime`, start / dispatch / graceful stop.
- `echo_service`: the minimal service (`python -m kvfabric.runtime.echo_service`).

What callers share (`request`, `error_from_response`, the shard router, NATS auth) is in
`kvfabric.cluster`; the client and engines never import this package (an import contract).
"""

from kvfabric.runtime.config import RuntimeSettings, SettingsError, load_settings
from kvfabric.runtime.inflight import InflightLimiter
from kvfabric.runtime.logs import configure_logging, get_logger, request_context
from kvfabric.runtime.metrics import MetricsServer, Outcome, ServiceMetrics
from kvfabric.runtime.replies import ErrorResponse, error_response, internal_error
from kvfabric.runtime.service import EXIT_OK, EXIT_SOFTWARE, EXIT_UNAVAILABLE, Handler, ServiceRuntime

__all__ = [
    "EXIT_OK",
    "EXIT_SOFTWARE",
    "EXIT_UNAVAILABLE",
    "ErrorResponse",
    "Handler",
    "InflightLimiter",
    "MetricsServer",
    "Outcome",
    "RuntimeSettings",
    "ServiceMetrics",
    "ServiceRuntime",
    "SettingsError",
    "configure_logging",
    "error_response",
    "get_logger",
    "internal_error",
    "load_settings",
    "request_context",
]

"""structlog configuration and the per-request log context.

Output: one JSON object per line when the stream is not a TTY (or `json=True`), a readable
console rendering on a TTY. Every line carries `event` (past-tense snake_case), `level`,
`timestamp` (UTC ISO-8601) and whatever is bound. stdlib `logging` (nats-py, asyncio) is routed
to the same stream and format.

Context: `service` and `instance_id` are bound by the runtime; at handler entry
`request_context` binds `subject`, `request_id` and `trace_id` (from the `Kvf-Request-Id` and
`Kvf-Trace-Id` headers) in contextvars, so code a handler calls logs them too. Payload bytes are
never logged.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final, TextIO

import structlog
from structlog.typing import FilteringBoundLogger, Processor

from kvfabric.proto.common import REQUEST_ID_HEADER, TRACE_ID_HEADER

__all__ = [
    "HEADER_VALUE_LOGGED_CHARS_MAX",
    "RequestIds",
    "configure_logging",
    "get_logger",
    "request_context",
    "request_ids",
]

# Ids come from the wire: cap what is logged so a client cannot blow up log lines.
HEADER_VALUE_LOGGED_CHARS_MAX: Final = 128
_STDLIB_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def configure_logging(*, level: str = "info", json: bool | None = None, stream: TextIO | None = None) -> bool:
    """Configure structlog (and stdlib logging) process-wide. Returns whether output is JSON."""
    out = sys.stderr if stream is None else stream
    level_no = _STDLIB_LEVELS[level]
    use_json = (not _isatty(out)) if json is None else json
    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=_isatty(out))
    )
    exceptions: list[Processor] = [structlog.processors.format_exc_info] if use_json else []
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            structlog.processors.StackInfoRenderer(),
            *exceptions,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name, timestamper],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *exceptions, renderer],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_no)
    return use_json


def get_logger(name: str) -> FilteringBoundLogger:
    """A structlog logger; `name` is bound as `logger`."""
    log: FilteringBoundLogger = structlog.get_logger(name).bind(logger=name)
    return log


@dataclass(frozen=True, slots=True)
class RequestIds:
    request_id: str | None
    trace_id: str | None


def _header_value(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None or value == "":
        return None
    return value[:HEADER_VALUE_LOGGED_CHARS_MAX]


def request_ids(headers: Mapping[str, str]) -> RequestIds:
    """`Kvf-Request-Id` and `Kvf-Trace-Id` from request headers, capped in length."""
    return RequestIds(
        request_id=_header_value(headers, REQUEST_ID_HEADER),
        trace_id=_header_value(headers, TRACE_ID_HEADER),
    )


@contextmanager
def request_context(*, subject: str, headers: Mapping[str, str], **bound: object) -> Iterator[RequestIds]:
    """Bind `subject`, `request_id`, `trace_id` (and `bound`) in contextvars for one request; unbind after."""
    ids = request_ids(headers)
    with structlog.contextvars.bound_contextvars(
        subject=subject, request_id=ids.request_id, trace_id=ids.trace_id, **bound
    ):
        yield ids


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False

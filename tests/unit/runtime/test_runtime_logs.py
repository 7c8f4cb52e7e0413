"""structlog setup: JSON lines off a TTY, request context bound per request and unbound after."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog

from kvfabric.runtime.logs import (
    HEADER_VALUE_LOGGED_CHARS_MAX,
    configure_logging,
    get_logger,
    request_context,
    request_ids,
)

LogRecords = Callable[[], list[dict[str, Any]]]  # the `json_logs` fixture (tests/conftest.py)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    yield
    structlog.reset_defaults()
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)


def test_json_lines_with_event_level_timestamp(json_logs: LogRecords) -> None:
    get_logger("t").bind(service="echo").info("thing_happened", count=2)
    (record,) = json_logs()
    assert record["event"] == "thing_happened"
    assert (record["level"], record["logger"], record["service"], record["count"]) == ("info", "t", "echo", 2)
    assert record["timestamp"].endswith("Z")


@pytest.mark.usefixtures("restore_logging")
def test_auto_is_json_off_a_tty_and_console_on_one() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    plain = io.StringIO()
    assert configure_logging(stream=plain) is True
    get_logger("t").info("to_pipe")
    assert json.loads(plain.getvalue())["event"] == "to_pipe"

    tty = Tty()
    assert configure_logging(stream=tty) is False
    get_logger("t").info("to_terminal")
    assert "to_terminal" in tty.getvalue()
    assert not tty.getvalue().startswith("{")


@pytest.mark.usefixtures("restore_logging")
def test_level_filters() -> None:
    out = io.StringIO()
    configure_logging(level="warning", json=True, stream=out)
    get_logger("t").info("dropped")
    get_logger("t").warning("kept")
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["kept"]


def test_stdlib_logging_goes_to_the_same_stream_as_json(json_logs: LogRecords) -> None:
    logging.getLogger("nats.aio.client").error("nats: encountered error")
    (record,) = json_logs()
    assert (record["event"], record["level"], record["logger"]) == (
        "nats: encountered error",
        "error",
        "nats.aio.client",
    )


def test_request_context_binds_then_unbinds(json_logs: LogRecords) -> None:
    log = get_logger("t")
    headers = {"Kvf-Request-Id": "r-1", "Kvf-Trace-Id": "t-1"}
    with request_context(subject="kvf.v1.echo.say", headers=headers) as ids:
        assert (ids.request_id, ids.trace_id) == ("r-1", "t-1")
        log.info("inside_handled")
    log.info("outside_logged")
    inside, outside = json_logs()
    assert (inside["subject"], inside["request_id"], inside["trace_id"]) == ("kvf.v1.echo.say", "r-1", "t-1")
    assert "request_id" not in outside
    assert "subject" not in outside


def test_request_ids_are_capped_and_empty_means_absent() -> None:
    ids = request_ids({"Kvf-Request-Id": "r" * 10_000, "Kvf-Trace-Id": ""})
    assert ids.request_id == "r" * HEADER_VALUE_LOGGED_CHARS_MAX
    assert ids.trace_id is None
    assert request_ids({}).request_id is None


def test_exceptions_render_as_text_in_json(json_logs: LogRecords) -> None:
    try:
        raise ValueError("kaput")
    except ValueError as exc:
        get_logger("t").error("request_handled", exc_info=exc)
    (record,) = json_logs()
    assert "ValueError: kaput" in record["exception"]

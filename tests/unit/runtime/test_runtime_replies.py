"""Error mapping both ways: `KvfError` -> service-error headers + `ErrorReply` body -> `KvfError`."""

from __future__ import annotations

import pytest

from kvfabric.cluster.requests import error_from_response
from kvfabric.format.errors import (
    BadRequest,
    BatchTooLarge,
    Busy,
    Exists,
    Indeterminate,
    KvfError,
    NoCapacity,
    NotFound,
    StaleGeneration,
    Unavailable,
    UnsupportedVersion,
)
from kvfabric.proto.codec import encode
from kvfabric.proto.common import ErrorReply
from kvfabric.runtime.replies import (
    DESCRIPTION_CHARS_MAX,
    error_response,
    header_safe,
    internal_error,
)


def _wire_headers(err: KvfError) -> dict[str, str]:
    """What `respond_error` puts on the reply: ours plus the two ADR-32 headers."""
    response = error_response(err)
    return {
        **response.headers,
        "Nats-Service-Error-Code": response.status,
        "Nats-Service-Error": response.description,
    }


@pytest.mark.parametrize(
    "err",
    [
        BadRequest("bad field", field="text"),
        BatchTooLarge("too many", count=900),
        Busy("in-flight limit reached", inflight_max=2),
        Exists("already published"),
        NotFound("no such key"),
        NoCapacity("segment full", bytes_free=0),
        Unavailable("no segment"),
        Indeterminate("timed out"),
        StaleGeneration("epoch", seen=3, current=4),
        UnsupportedVersion("manifest", 9, (1, 2)),
        KvfError("internal error (ValueError)"),
    ],
    ids=lambda e: e.code,
)
def test_round_trip_keeps_type_code_message_details(err: KvfError) -> None:
    response = error_response(err)
    assert response.status == str(err.status)
    assert response.headers == {"Kvf-Error-Code": err.code}

    back = error_from_response(_wire_headers(err), response.data)
    assert type(back) is type(err)
    assert back is not None
    assert (back.code, back.message, back.details, back.retryable) == (
        err.code,
        err.message,
        err.details,
        err.retryable,
    )


def test_success_reply_is_not_an_error() -> None:
    assert error_from_response(None, b"anything") is None
    assert error_from_response({"Kvf-Trace-Id": "t"}, b"") is None


def test_headers_alone_still_give_the_type() -> None:
    """A body that is not an ErrorReply (e.g. empty): the Kvf-Error-Code header decides."""
    err = error_from_response(
        {"Nats-Service-Error-Code": "503", "Nats-Service-Error": "full", "Kvf-Error-Code": "busy"}, b""
    )
    assert isinstance(err, Busy)
    assert (err.message, err.details) == ("full", {"status": "503"})


def test_foreign_service_error_maps_to_the_root() -> None:
    """A plain nats.micro 500 (no kvfabric header, body not ours)."""
    err = error_from_response({"Nats-Service-Error-Code": "500", "Nats-Service-Error": "boom"}, b"\xc1")
    assert type(err) is KvfError
    assert err is not None
    assert err.message == "service error 500: boom"


def test_unknown_code_from_a_newer_build_maps_to_the_root() -> None:
    body = encode(ErrorReply(code="brand_new_code", message="m", retryable=True))
    err = error_from_response({"Nats-Service-Error-Code": "418"}, body)
    assert type(err) is KvfError
    assert err is not None
    assert err.message == "m"


def test_description_is_one_short_line() -> None:
    err = BadRequest("line one\r\nline two " + "x" * 1000)
    description = error_response(err).description
    assert "\n" not in description
    assert "\r" not in description
    assert len(description) == DESCRIPTION_CHARS_MAX
    assert description.startswith("line one  line two")
    # The body keeps the full message.
    back = error_from_response(_wire_headers(err), error_response(err).data)
    assert back is not None
    assert back.message == err.message
    assert header_safe("short") == "short"


def test_internal_error_names_the_type_not_the_text() -> None:
    err = internal_error(ValueError("tenant secret"))
    assert (err.code, err.status, err.retryable) == ("internal", 500, False)
    assert "tenant secret" not in err.message
    assert err.details == {"exception": "ValueError"}

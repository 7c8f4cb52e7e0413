"""What kvctl says when it cannot reach NATS (`kvfabric.ctl.queries.connect_error`): a refusal
names the credentials it used and where a local cluster's operator credentials are, a timeout
says so, anything else names the error's text, not only its type."""

from __future__ import annotations

import nats.errors

from kvfabric.ctl.queries import connect_error
from kvfabric.format.errors import Unauthorized, Unavailable

URL = "nats://127.0.0.1:4222"
REFUSED = nats.errors.Error("nats: 'Authorization Violation'")


def test_a_refusal_without_credentials_says_none_are_set_and_where_they_are() -> None:
    error = connect_error(URL, REFUSED, user="", timeout_s=5)
    assert isinstance(error, Unauthorized) and error.code == "unauthorized"
    assert "Authorization Violation" in error.message and "none are set (KVF_NATS_USER" in error.message
    assert ".data/auth/env/admin.env" in error.message


def test_a_refusal_of_a_user_names_it() -> None:
    error = connect_error(URL, REFUSED, user="admin", timeout_s=5)
    assert (
        isinstance(error, Unauthorized)
        and "KVF_NATS_USER=admin and its password were refused" in error.message
    )


def test_a_timeout_and_other_errors_are_unavailable_with_their_text() -> None:
    timeout = connect_error(URL, TimeoutError(), user="", timeout_s=2.5)
    assert isinstance(timeout, Unavailable) and "no connection within 2.5 s" in timeout.message
    refused = connect_error(URL, ConnectionRefusedError(111, "Connection refused"), user="", timeout_s=5)
    assert isinstance(refused, Unavailable)
    assert refused.message.endswith("ConnectionRefusedError: [Errno 111] Connection refused")
    other = connect_error(
        URL, nats.errors.Error("nats: 'Maximum Connections Exceeded'"), user="u", timeout_s=5
    )
    assert isinstance(other, Unavailable) and other.message.endswith("nats: 'Maximum Connections Exceeded'")

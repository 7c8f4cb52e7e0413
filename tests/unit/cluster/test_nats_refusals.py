"""Which NATS server answers end a connect at once (refused: another attempt cannot change them)
and which do not (review, stop 68): "Authentication Timeout", the server's answer to a CONNECT that
came after its auth_timeout (a busy host, a slow TLS handshake), was taken for refused
credentials, and the client gave up at once instead of trying again."""

from __future__ import annotations

import nats.errors
import pytest

from kvfabric.cluster.natsauth import is_nats_refusal


@pytest.mark.parametrize(
    "text",
    [
        "nats: 'Authorization Violation'",
        "nats: 'Permissions Violation for Publish to \"x\"'",
        "nats: 'User Authentication Expired'",
        "nats: 'User Authentication Revoked'",
        "nats: 'Account Authentication Expired'",
    ],
)
def test_refusals_end_the_connect(text: str) -> None:
    assert is_nats_refusal(nats.errors.Error(text))


@pytest.mark.parametrize("text", ["nats: 'Authentication Timeout'", "nats: 'Stale Connection'"])
def test_a_late_connect_is_not_a_refusal(text: str) -> None:
    assert not is_nats_refusal(nats.errors.Error(text))


def test_only_nats_errors_are_refusals() -> None:
    assert not is_nats_refusal(OSError("Authorization Violation"))

"""`decode_as`: an endpoint's one message type, decoded and checked in one call (issue 26)."""

from __future__ import annotations

import pytest

from kvfabric.format.errors import BadRequest
from kvfabric.proto import prefetch as p
from kvfabric.proto.codec import decode_as, encode


def test_the_type_asked_for_comes_back_typed() -> None:
    data = encode(p.CancelHint(hint_id="h1"))
    message = decode_as(p.prefetch_decoder, data, p.CancelHint, "cancel")
    assert message == p.CancelHint(hint_id="h1")


def test_another_message_of_the_family_is_a_bad_request_naming_both_types() -> None:
    data = encode(p.PrefetchStatusRequest())
    with pytest.raises(BadRequest, match="cancel takes CancelHint, got PrefetchStatusRequest"):
        decode_as(p.prefetch_decoder, data, p.CancelHint, "cancel")
    with pytest.raises(BadRequest, match="expected CancelHint, got PrefetchStatusRequest"):
        decode_as(p.prefetch_decoder, data, p.CancelHint)


def test_a_malformed_message_is_the_decoders_bad_request() -> None:
    with pytest.raises(BadRequest, match="malformed"):
        decode_as(p.prefetch_decoder, b"\xc1 not msgpack", p.CancelHint, "cancel")

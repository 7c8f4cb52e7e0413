"""A trace id a data-plane PUT carries is printable ASCII without spaces, at most
`TRACE_ID_CHARS_MAX` characters (review, stop 68): the segment puts a writer's into the header
of its confirm request to the directory, where a megabyte one (the frame meta's own bound) made
the NATS message exceed max_payload, and a CR/LF broke the header; NATS then closed the segment's
connection, every tenant's confirms with it. Clients cut or replace their engine's ids to fit."""

from __future__ import annotations

import pytest

from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import ObjectKey
from kvfabric.proto.codec import encode
from kvfabric.proto.common import TRACE_ID_CHARS_MAX, trace_id_of
from kvfabric.proto.dataplane import PutRequest, dataplane_decoder
from kvfabric.proto.directory import WriteTicket

TICKET = WriteTicket(
    ticket_id=1,
    key=ObjectKey(b"k"),
    segment_id="s",
    incarnation=1,
    size_bytes=1,
    checksum=b"c",
    writer_id="w",
    deadline_ms=1,
    epoch=1,
    data_addr="tcp://s",
)


def _decoded(trace_id: str) -> object:
    return dataplane_decoder.decode(encode(PutRequest(ticket=TICKET, trace_id=trace_id)))


def test_a_put_with_a_fitting_trace_id_decodes() -> None:
    given = "cmpl-" + "a" * (TRACE_ID_CHARS_MAX - 5)
    decoded = _decoded(given)
    assert isinstance(decoded, PutRequest) and decoded.trace_id == given
    assert isinstance(_decoded(""), PutRequest)


@pytest.mark.parametrize(
    "bad", ["x" * (TRACE_ID_CHARS_MAX + 1), "x" * 1_000_000, "a\r\nKvf-Error-Code: x", "a b", "é"]
)
def test_a_put_whose_trace_id_could_break_a_nats_header_is_a_bad_request(bad: str) -> None:
    with pytest.raises(BadRequest):
        _decoded(bad)


def test_clients_keep_a_fitting_id_cut_a_long_one_and_replace_the_rest() -> None:
    assert trace_id_of("cmpl-42-0") == "cmpl-42-0"
    assert trace_id_of("x" * 500) == "x" * TRACE_ID_CHARS_MAX
    for bad in (None, "", "a b", "a\r\nb", "é"):
        new = trace_id_of(bad)
        assert len(new) == 32 and new.isalnum() and new != trace_id_of(bad)  # a fresh one each time
    for given in ("cmpl-42-0", "x" * 500, "a b", None):
        assert isinstance(_decoded(trace_id_of(given)), PutRequest)

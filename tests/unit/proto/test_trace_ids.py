"""Trace ids that go into NATS headers (review, stop 68): a segment put a writer's, as its PUT
carried it, into the header of its confirm request to the directory, where a megabyte one (the
frame meta's own bound) made the message exceed max_payload and a CR/LF broke the header; NATS
then closed the segment's connection, every tenant's confirms with it. Senders cut or replace
theirs (`trace_id_of`), the segment forwards only one that fits (`header_trace_id`), and the
wire field stays a plain string: refused at decode, an older client's id dropped its whole data
connection (review of the fix)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.common import TRACE_ID_CHARS_MAX, TRACE_ID_HEADER, header_trace_id, trace_id_of
from kvfabric.proto.dataplane import PutRequest, dataplane_decoder
from kvfabric.proto.directory import WriteTicket
from kvfabric.segment_storage.shell_directory import ShellDirectory

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
UNFIT = ["x" * (TRACE_ID_CHARS_MAX + 1), "x" * 100_000, "a\r\nKvf-Error-Code: x", "a b", "é", "abc\n"]


@pytest.mark.parametrize("given", ["cmpl-42-0", "", *UNFIT])
def test_a_put_decodes_whatever_trace_id_it_carries(given: str) -> None:
    decoded = dataplane_decoder.decode(encode(PutRequest(ticket=TICKET, trace_id=given)))
    assert isinstance(decoded, PutRequest) and decoded.trace_id == given


def test_only_a_trace_id_that_fits_a_header_is_forwarded() -> None:
    assert header_trace_id("cmpl-42-0") == "cmpl-42-0"
    assert header_trace_id("x" * TRACE_ID_CHARS_MAX) == "x" * TRACE_ID_CHARS_MAX
    assert all(header_trace_id(bad) == "" for bad in UNFIT)


def test_clients_keep_a_fitting_id_cut_a_long_one_and_replace_the_rest() -> None:
    assert trace_id_of("cmpl-42-0") == "cmpl-42-0"
    assert trace_id_of("x" * 500) == "x" * TRACE_ID_CHARS_MAX
    for bad in (None, "", "a b", "a\r\nb", "é", "abc\n"):
        new = trace_id_of(bad)
        assert len(new) == 32 and new.isalnum() and new != trace_id_of(bad)  # a fresh one each time


class _Router:
    def __init__(self) -> None:
        self.headers: list[dict[str, str] | None] = []

    def shard_of(self, key: bytes) -> int:
        return 0

    async def ask(self, shard: int, verb: str, message: Any, timeout_s: float, headers: Any = None) -> Any:
        self.headers.append(headers)
        return m.PutAbortReply(epoch=0, aborted=0)


@pytest.mark.parametrize(
    ("given", "sent"), [("cmpl-1", {TRACE_ID_HEADER: "cmpl-1"}), ("", None), *((b, None) for b in UNFIT)]
)
def test_the_segment_sends_a_confirm_with_a_header_only_when_the_trace_id_fits(
    given: str, sent: dict[str, str] | None
) -> None:
    shell = cast(Any, ShellDirectory.__new__(ShellDirectory))
    shell.router = _Router()
    shell._saw_epoch = lambda shard, epoch: None
    asyncio.run(
        shell._directory(
            "put_abort", m.PutAbort(writer_id="w", request_id="r", keys=[ObjectKey(b"k")]), given
        )
    )
    assert shell.router.headers == [sent]

"""`request` says whether a failed request may have run (review, stop 68): nats-py's
`OutboundBufferLimitError` (reconnecting, its buffer full) is raised before anything is written,
but it was reported `Indeterminate`, so the directory router forgot a healthy leader and callers
counted a timeout. A request that certainly did not leave is `Unavailable`."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import nats.errors
import pytest

from kvfabric.cluster.requests import request
from kvfabric.format.errors import Indeterminate, Unavailable
from kvfabric.proto import directory as m


class _Nats:
    is_closed = False
    is_draining = False

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def request(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error


def _ask(error: Exception) -> None:
    nc = cast(Any, _Nats(error))
    asyncio.run(
        request(
            nc, "kvf.v1.x", m.Heartbeat(segment_id="s", incarnation=1, used_bytes=0), m.reply_decoder, 1.0
        )
    )


@pytest.mark.parametrize(
    "error",
    [
        nats.errors.OutboundBufferLimitError(),
        nats.errors.ConnectionClosedError(),
        nats.errors.NoRespondersError(),
    ],
)
def test_a_request_that_never_left_is_unavailable(error: Exception) -> None:
    with pytest.raises(Unavailable):
        _ask(error)


def test_a_request_that_may_have_run_is_indeterminate() -> None:
    with pytest.raises(Indeterminate):
        _ask(nats.errors.TimeoutError())

"""`add_or_find_stream`: a `BadRequestError` from add_stream counts as "added meanwhile" only when
the stream is really there; any other refusal (a forming cluster, a bad configuration) is raised,
never taken for a repair done (the bug `leader._bucket` had with BucketNotFoundError)."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.js.errors
import pytest
from nats.js.api import StreamConfig

from kvfabric.directory.kv_doctor import add_or_find_stream

CONFIG = StreamConfig(name="S", subjects=["s"])


class FakeJs:
    def __init__(self, add_error: Exception | None, exists: bool) -> None:
        self.add_error = add_error
        self.exists = exists

    async def add_stream(self, config: StreamConfig) -> None:
        if self.add_error is not None:
            raise self.add_error

    async def stream_info(self, name: str) -> Any:
        if not self.exists:
            raise nats.js.errors.NotFoundError()
        return object()


def run(js: FakeJs) -> bool:
    return asyncio.run(add_or_find_stream(js, CONFIG))  # type: ignore[arg-type]


def test_added() -> None:
    assert run(FakeJs(None, exists=False)) is True


def test_refused_because_it_exists() -> None:
    assert run(FakeJs(nats.js.errors.BadRequestError(), exists=True)) is False


def test_refused_for_another_reason_is_raised() -> None:
    with pytest.raises(nats.js.errors.NotFoundError):
        run(FakeJs(nats.js.errors.BadRequestError(), exists=False))

"""A directory instance freezes what a round of shard starts built out of the cyclic GC's walk
(`kvfabric.runtime.gcpolicy`): the rebuilt cores' state is long-lived."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any, cast

import pytest

from kvfabric.core.directory import DirectoryConfig
from kvfabric.directory.shard_host import ShardHost
from kvfabric.runtime import gcpolicy


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    gcpolicy.uninstall()
    yield
    gcpolicy.uninstall()


def test_settled_shard_starts_freeze_under_the_policy() -> None:
    host = ShardHost(
        "dir-a",
        2,
        DirectoryConfig(ticket_secret=b"s" * 32),
        registry=cast(Any, None),
        make_shell=cast(Any, None),
    )
    gcpolicy.install()
    host._settled()
    walked = {id(o) for o in gc.get_objects()}
    assert gc.get_freeze_count() > 0 and id(host) not in walked and id(host.shells) not in walked

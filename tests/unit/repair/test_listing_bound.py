"""The repair scan's listing raises when its page bound cuts it (review, 2026-12-05): it went on
silently, so past `SCAN_PAGES_MAX` pages the later shards were never listed, their objects looked
gone and a drain never completed. A listing within the bound is read whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvfabric.format.errors import Unavailable
from kvfabric.format.ids import GroupKey
from kvfabric.proto import directory as m
from kvfabric.repair import shell as repair_shell
from tests.unit.repair.test_copy_source_failed import shell_with_object


class PagedRouter:
    """`shards` shards of `pages` pages each (every page but a shard's last names a next one)."""

    def __init__(self, shards: int, pages: int) -> None:
        self.shards, self.pages = shards, pages

    async def known_shards(self) -> int:
        return self.shards

    async def shard_pages(
        self, shard: int, query: Any, timeout_s: float, pages_max: int
    ) -> AsyncIterator[m.GroupList]:
        for i in range(min(self.pages, pages_max)):
            more = i < self.pages - 1
            yield m.GroupList(epoch=1, groups=[], next_after=GroupKey(b"x" if more else b""))


async def pages_of(shards: int, pages: int) -> int:
    shell, _ = shell_with_object()
    shell._dir = lambda: PagedRouter(shards, pages)  # type: ignore[method-assign,assignment,return-value]
    return len([p async for p in shell._pages(m.ListGroups())])


async def test_a_listing_over_the_page_bound_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repair_shell, "SCAN_PAGES_MAX", 6)
    assert await pages_of(shards=2, pages=3) == 6  # exactly the bound, whole
    with pytest.raises(Unavailable, match="over its bound"):
        await pages_of(shards=2, pages=4)  # the second shard cut
    with pytest.raises(Unavailable, match="over its bound"):
        await pages_of(shards=3, pages=3)  # a third shard never listed

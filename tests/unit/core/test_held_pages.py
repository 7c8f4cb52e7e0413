"""A page of held slots (what a segment reports to a rebuilding directory) walks ids up from
where the last page ended instead of filtering and sorting the whole table: 46-123 ms a page at
1 M slots, under the disk tier's lock with every disk GET waiting (review, 2026-12-06). Pages
are the same as before: every STORED slot above `after_slot`, lowest first."""

from __future__ import annotations

import random
from typing import Any

from kvfabric.core.segment_slots import SlotTable


class CountingDict(dict[int, Any]):
    looked = 0

    def get(self, key: int, default: Any = None) -> Any:
        CountingDict.looked += 1
        return super().get(key, default)

    def __getitem__(self, key: int) -> Any:
        CountingDict.looked += 1
        return super().__getitem__(key)

    def items(self) -> Any:
        CountingDict.looked += len(self)  # a walk of the whole table
        return super().items()


def test_pages_are_every_stored_slot_in_order_and_cost_their_span() -> None:
    table = SlotTable(64 << 20, alignment=64)
    rng = random.Random(7)
    live = []
    for i in range(4000):
        a = table.alloc(256, 0, 10_000, key=b"k%d" % i)
        table.stored(a.slot, a.generation, b"c" * 16)
        live.append((a.slot, a.generation))
    for slot, generation in rng.sample(live, 1000):  # freed ids scattered through the table
        table.free(slot, generation)
    writing = table.alloc(256, 0, 10_000)  # reuses the lowest free id: not STORED, not listed
    expected = sorted(s for s, rec in table._slots.items() if rec.state == "stored")
    table._slots = CountingDict(table._slots)
    pages: list[int] = []
    after = -1
    while True:
        CountingDict.looked = 0
        page = table.held(after, limit=256)
        if not page:
            break
        span = page[-1].slot - after
        assert CountingDict.looked <= span  # the ids walked, not the table
        pages.extend(h.slot for h in page)
        after = page[-1].slot
    assert pages == expected and writing.slot not in pages

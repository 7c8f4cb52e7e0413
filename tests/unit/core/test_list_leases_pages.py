"""`list_leases` pages (review, 2026-12-05): 10,000 leases with long holder ids made a reply of
~2 MB, which NATS dropped (the caller timed out); and the listing was cut at `limit` before a
caller could keep only the pins. Now a page ends at `limit`, at `LEASES_EXAMINED_MAX` leases
examined, or before the reply passes `REPLY_BYTES_MAX`; `next_after` starts the next page, and
`pins_only` filters before the limit."""

from __future__ import annotations

from kvfabric.core.directory import DirectoryCore
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from tests.unit.core.dirkit import groups, key, lookup, new_core, put, register


def leases_of(core: DirectoryCore, limit: int, pins_only: bool = False) -> list[m.LeaseList]:
    pages = []
    after = 0
    while True:
        page = core.handle(m.ListLeases(after=after, limit=limit, pins_only=pins_only), 0).reply
        assert isinstance(page, m.LeaseList)
        pages.append(page)
        if not page.next_after:
            return pages
        after = page.next_after


def test_pages_cover_every_lease_once_and_fit_a_reply() -> None:
    core = new_core()
    register(core, "s1")
    gs = groups(2)
    put(core, [key(g) for g in gs])
    holder = "h" * m.HOLDER_ID_CHARS_MAX
    for _ in range(9_000):
        lookup(core, gs[:1], holder=holder, ttl=60_000)
    pins = [
        core.handle(m.Pin(holder_id=f"pin{i}", groups=[gs[1].group_id()], ttl_ms=60_000), 0).reply
        for i in range(3)
    ]
    pages = leases_of(core, limit=m.LIST_LIMIT_MAX)
    assert len(pages) >= 2  # cut by bytes, not the limit
    assert all(len(encode(p)) <= m.REPLY_BYTES_MAX for p in pages)
    ids = [x.lease_id for p in pages for x in p.leases]
    assert ids == sorted(set(ids)) and len(ids) == 9_003
    only_pins = leases_of(core, limit=2, pins_only=True)
    listed = [x for p in only_pins for x in p.leases]
    assert [x.lease_id for x in listed] == [p.pin_id for p in pins if isinstance(p, m.PinReply)]
    assert all(x.is_pin for x in listed) and [len(p.leases) for p in only_pins][:1] == [2]

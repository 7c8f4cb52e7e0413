"""The directory core's long-lived state is invisible to CPython's cyclic GC (issue 20): a full
collection walks every tracked object, so per-object Python containers would make its pauses,
and the directory's tail latency, grow with the objects and requests held
(`kvfabric.runtime.gcpolicy`, docs/directory.md)."""

from __future__ import annotations

import gc

from kvfabric.proto import directory as m

from .dirkit import groups, key, lookup, new_core, put, register

OBJECTS = 2_000


def test_published_records_and_cached_replies_add_no_tracked_objects() -> None:
    core = new_core()
    register(core, "s1", capacity=1 << 40)
    gs = groups(OBJECTS + 1)
    put(core, [key(gs[0])], request_id="warm")
    gc.collect()
    before = len(gc.get_objects())
    for i, g in enumerate(gs[1:]):
        put(core, [key(g)], request_id=f"r{i}")  # one cached put_begin reply per request
        core.tick(0)
    gc.collect()
    grown = len(gc.get_objects()) - before

    assert len(core.published) == OBJECTS + 1
    assert not any(gc.is_tracked(record) for record in core.published.values())
    # Each cached reply as a Struct would be ~5 tracked objects (reply, results, result,
    # tickets, ticket): 10,000 here. Kept encoded, it is none.
    assert grown < OBJECTS // 20, grown


def test_a_retried_put_begin_still_gets_the_reply_it_got_first() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    begin = m.PutBegin(
        writer_id="w", request_id="1", objects=[m.ObjectSpec(key=key(g), size_bytes=100, checksum=b"c" * 16)]
    )
    first = core.handle(begin, 0).reply
    again = core.handle(begin, 10).reply
    assert isinstance(first, m.PutBeginReply) and again == first
    assert core.counters["retried_request_total"] == 1
    assert lookup(core, [g]).hit_chunks == 0

"""Per-tenant budgets of the directory core (issue 21 rows 3, 4, 5, 12), as short scripts.

A tenant is the scope of its writer / holder ids (`<tenant>/<name>`, set by the directory shell
for authenticated tenants). Its writes in progress are bounded in objects and in reserved bytes
(a fraction of the capacity), a write deadline and a tenant's pin are shortened to what is
needed, placement sees free space only in grains, and a put_begin whose reply could exceed
the reply budget is refused before anything is placed.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.core.directory import DirectoryCore
from kvfabric.format.errors import BadRequest, BatchTooLarge, Busy
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode

from .dirkit import confirm_all, groups, key, lookup, new_core, put, register, spec

GS = groups(64)
KEYS = [key(g) for g in GS]
REQUEST_IDS = itertools.count()


def begin(
    core: DirectoryCore, writer: str, keys: list[ObjectKey], size: int = 100, now: int = 0, **kw: int
) -> m.PutBeginReply:
    request = m.PutBegin(
        writer_id=writer, request_id=f"r{next(REQUEST_IDS)}", objects=[spec(k, size) for k in keys], **kw
    )
    reply = core.handle(request, now).reply
    assert isinstance(reply, m.PutBeginReply)
    return reply


def state(core: DirectoryCore) -> tuple[object, ...]:
    return (
        sorted(core.building),
        core.pending_objects,
        [(s.segment_id, s.reserved_bytes) for s in core.segments.values()],
        len(core._reply_cache),
    )


def test_a_tenant_writing_without_end_holds_at_most_its_objects_and_bytes_budget() -> None:
    """Row 3 and 4: bob begins and never writes; past his budgets he is `busy` (nothing placed)
    while alice, sharing the segment and the pending table, still begins and publishes."""
    core = new_core(tenant_pending_objects_max=4, tenant_pending_capacity_fraction=0.25)
    register(core, "s1", capacity=10_000)
    assert {r.status for r in begin(core, "bob/w", KEYS[0:2], size=1_000).results} == {"placed"}
    before = state(core)
    with pytest.raises(Busy, match="bytes") as bytes_refusal:  # 2,000 held + 1,000 > 10,000 / 4
        begin(core, "bob/w", KEYS[2:3], size=1_000)
    # answered at once within his fair budget: never counts to his tarpit (docs/security.md)
    assert not bytes_refusal.value.tenants_own
    assert state(core) == before
    assert {r.status for r in begin(core, "bob/w2", KEYS[2:4], size=100).results} == {"placed"}
    before = state(core)
    with pytest.raises(Busy, match="objects") as objects_refusal:  # 4 being written, his too
        begin(core, "bob/w", KEYS[4:5], size=10)
    assert not objects_refusal.value.tenants_own  # (the same: honest retries would count)
    assert state(core) == before
    commit = put(core, KEYS[10:12], writer="alice/w", request_id="a")
    assert [r.status for r in commit.results] == ["published", "published"]
    # A re-begin of what bob already holds is not new: answered (in_flight: another request of
    # his is writing it), not refused.
    again = core.handle(
        m.PutBegin(writer_id="bob/w", request_id="again", objects=[spec(KEYS[0], 1_000)]), 0
    ).reply
    assert isinstance(again, m.PutBeginReply) and again.results[0].status == "in_flight"
    # Giving back (abort, deadline) gives the budget back.
    core.handle(m.PutAbort(writer_id="bob/w", request_id="x", keys=KEYS[0:2]), 0)
    assert {r.status for r in begin(core, "bob/w", KEYS[4:5], size=1_000).results} == {"placed"}
    assert core.counters["busy_tenant_pending_bytes_total"] == 1
    assert core.counters["busy_tenant_pending_objects_total"] == 1
    core.check_invariants()


def test_published_and_committed_writes_leave_the_budget() -> None:
    core = new_core(tenant_pending_objects_max=2)
    register(core, "s1")
    put(core, KEYS[0:2], writer="carol/w")  # published: nothing pending
    assert core._scope_pending_objects == {} and core._scope_pending_bytes == {}
    (g,) = groups(1, seed=7, tp_size=2)
    rank0 = begin(core, "carol/w", [key(g, rank=0)])
    confirm_all(core, rank0, 0)
    core.handle(m.PutCommit(writer_id="carol/w", request_id="c", keys=[key(g, rank=0)]), 0)
    # Committed but its group incomplete: still held (until its deadline), still counted.
    assert core._scope_pending_objects == {"carol": 1}
    core.tick(60_000)
    assert core._scope_pending_objects == {} and core._scope_pending_bytes == {}
    core.check_invariants()


def test_unscoped_service_writers_have_only_the_global_bound() -> None:
    core = new_core(tenant_pending_objects_max=1, pending_objects_max=3)
    register(core, "s1")
    begin(core, "repair", KEYS[0:3])
    with pytest.raises(Busy, match="too many objects") as full:
        begin(core, "alice/w", KEYS[3:4])
    assert not full.value.tenants_own  # the table for all is full: not alice's doing


def test_write_deadlines_are_shortened_to_what_a_write_needs() -> None:
    """Row 3: a put_begin asking 600 s gets `write_ttl_ms_max` (30 s); its reservation goes then."""
    core = new_core()
    register(core, "s1", capacity=10_000)
    reply = begin(core, "bob/w", KEYS[0:1], write_ttl_ms=m.WRITE_TTL_MS_MAX, now=1_000)
    assert reply.results[0].deadline_ms == 1_000 + 30_000
    assert reply.results[0].tickets[0].deadline_ms == 1_000 + 30_000
    core.tick(1_000 + 30_000)
    assert core.segments["s1"].reserved_bytes == 0 and not core.building
    core.check_invariants()


def test_a_tenants_pin_lasts_at_most_the_tenant_maximum() -> None:
    """Row 5: a tenant asking a 24 h pin gets one hour; a service pin keeps what it asked."""
    core = new_core()
    register(core, "s1")
    put(core, KEYS[0:1])
    pin = m.Pin(holder_id="bob/h", groups=[GS[0].group_id()], ttl_ms=m.PIN_TTL_MS_MAX)
    reply = core.handle(pin, 5).reply
    assert isinstance(reply, m.PinReply) and reply.expires_ms == 5 + 3_600_000
    admin = core.handle(msgspec.structs.replace(pin, holder_id="kvctl"), 5).reply
    assert isinstance(admin, m.PinReply) and admin.expires_ms == 5 + m.PIN_TTL_MS_MAX


@pytest.mark.parametrize("field", ["holder_id", "writer_id", "request_id"])
def test_ids_longer_than_their_bound_do_not_decode(field: str) -> None:
    """Row 5: 900 KiB holder ids (kept for 24 h with their pin) fail to decode: `bad_request`."""
    limit = m.REQUEST_ID_CHARS_MAX if field == "request_id" else m.HOLDER_ID_CHARS_MAX
    kinds: dict[str, list[msgspec.Struct]] = {
        "holder_id": [
            m.Pin(holder_id="h", groups=[], ttl_ms=1),
            m.Lookup(holder_id="h", groups=[]),
            m.LookupMany(holder_id="h", parts=[]),
            m.Unpin(holder_id="h", pin_id=1),
            m.LeaseRelease(holder_id="h", lease_id=1),
            m.LeaseRenew(holder_id="h", lease_id=1),
        ],
        "writer_id": [m.PutBegin(writer_id="w", request_id="r", objects=[])],
        "request_id": [m.PutBegin(writer_id="w", request_id="r", objects=[])],
    }
    kinds["writer_id"] += [
        m.PutCommit(writer_id="w", request_id="r", keys=[]),
        m.PutAbort(writer_id="w", request_id="r", keys=[]),
    ]
    kinds["request_id"] += [m.PutCommit(writer_id="w", request_id="r", keys=[])]
    for message in kinds[field]:
        ok = msgspec.structs.replace(message, **{field: "é" * limit})
        assert m.request_decoder.decode(encode(ok)) == ok
        with pytest.raises(BadRequest):
            m.request_decoder.decode(encode(msgspec.structs.replace(message, **{field: "x" * (limit + 1)})))


def test_empty_put_begins_cannot_grow_the_reply_cache() -> None:
    core = new_core(reply_cache_objects_max=100)
    register(core, "s1")
    for i in range(1_000):
        core.handle(m.PutBegin(writer_id="bob/w", request_id=f"r{i}", objects=[]), 0)
    assert len(core._reply_cache) == 100


def test_which_objects_fit_tells_free_space_only_to_a_grain() -> None:
    """Row 3: placement sees a segment's free bytes in 1/64ths of its capacity, so a writer that
    bisects object sizes learns the free space to a grain (1,000 of 64,000 here), not exactly."""

    def fits(core: DirectoryCore, size: int) -> str:
        status = begin(core, "bob/w", KEYS[:1], size=size).results[0].status
        core.handle(m.PutAbort(writer_id="bob/w", request_id="x", keys=KEYS[:1]), 0)
        return status

    answers = []
    for used in (1, 500, 1_000):  # free space within one grain (63,000..63,999): the same answers
        core = new_core(tenant_pending_capacity_fraction=1.0)
        register(core, "s1", capacity=64_000)
        begin(core, "alice/w", KEYS[60:61], size=used)
        answers.append([fits(core, size) for size in (62_000, 63_000, 63_001, 64_000)])
    assert answers == [["placed", "placed", "no_capacity", "no_capacity"]] * 3
    exact = new_core(tenant_pending_capacity_fraction=1.0, free_bytes_granules=0)
    register(exact, "s1", capacity=64_000)
    assert fits(exact, 64_000) == "placed"  # granules 0: exact, as before


@settings(max_examples=60)
@given(
    objects=st.integers(1, 120),
    replicas=st.integers(1, 5),
    writer=st.integers(1, m.HOLDER_ID_CHARS_MAX),
    segment_id=st.integers(1, 64),
    data_addr=st.integers(0, 300),
)
def test_a_put_begin_reply_never_exceeds_the_reply_budget(
    objects: int, replicas: int, writer: int, segment_id: int, data_addr: int
) -> None:
    """Row 12: either the whole request is refused (`batch_too_large`, naming how many fit) with
    nothing placed, or the encoded reply fits in `reply_bytes_max`."""
    core = new_core(replicas_max=5, reply_bytes_max=40_000, tenant_pending_capacity_fraction=1.0)
    for i in range(5):
        core.handle(
            m.RegisterSegment(
                segment_id=f"{i}".ljust(segment_id, "s"),
                incarnation=1,
                capacity_bytes=1 << 40,
                domain=m.FailureDomain(host=f"h{i}", zone=f"z{i}"),
                data_addr="tcp://" + "a" * data_addr,
            ),
            0,
        )
    writer_id = "bob/" + "w" * writer
    request = m.PutBegin(
        writer_id=writer_id,
        request_id="r",
        replicas=replicas,
        objects=[spec(k, 1 << 20) for k in KEYS[:objects]],
    )
    before = state(core)
    try:
        reply = core.handle(request, 0).reply
    except BatchTooLarge as err:
        assert state(core) == before
        fits = err.details["limit"]
        assert 0 <= fits < objects
        if fits:  # what it says fits does fit
            smaller = msgspec.structs.replace(request, objects=request.objects[:fits], request_id="s")
            assert len(encode(core.handle(smaller, 0).reply)) <= 40_000
        return
    assert len(encode(reply)) <= 40_000
    core.check_invariants()


def test_the_batch_clients_send_fits_at_five_replicas_and_the_longest_ids() -> None:
    core = new_core(replicas_max=5, tenant_pending_capacity_fraction=1.0)
    for i in range(5):
        core.handle(
            m.RegisterSegment(
                segment_id=f"segment-{i}-" + "s" * 40,
                incarnation=1,
                capacity_bytes=1 << 40,
                domain=m.FailureDomain(host=f"h{i}", zone=f"z{i}"),
                data_addr=" ".join(f"{s}://[fd00::{i}]:40000" for s in ("ucx", "tcp", "shm")) + "a" * 100,
            ),
            0,
        )
    writer = "t" * 32 + "/" + "w" * m.HOLDER_ID_CHARS_MAX  # the scoped id of the longest tenant
    many = groups(m.PUT_BEGIN_BATCH_OBJECTS_FIT, seed=3)
    request = m.PutBegin(
        writer_id=writer, request_id="r", replicas=5, objects=[spec(key(g), 1 << 20) for g in many]
    )
    reply = core.handle(request, 0).reply
    assert len(encode(reply)) <= m.REPLY_BYTES_MAX
    assert lookup(core, many[:1]).hit_chunks == 0  # (placed, not readable)

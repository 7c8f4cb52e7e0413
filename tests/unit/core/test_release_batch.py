"""A batched lease release (issue 20): one request gives back up to `RELEASE_BATCH_LEASES_MAX`
leases of one holder; ids it does not hold are skipped, never an error (a retried batch is a
no-op); the single form is unchanged, and its old encoding still decodes."""

from __future__ import annotations

import msgspec
import pytest

from kvfabric.core.directory import DirectoryCore
from kvfabric.format.errors import BadRequest, BatchTooLarge, NotFound
from kvfabric.format.ids import GroupId
from kvfabric.proto import directory as m

from .dirkit import groups, key, lookup, new_core, put, register


def release(core: DirectoryCore, holder: str, lease_ids: list[int]) -> m.LeaseReply:
    reply = core.handle(m.LeaseRelease(holder_id=holder, lease_id=0, lease_ids=lease_ids), 0).reply
    assert isinstance(reply, m.LeaseReply)
    return reply


def evict_status(core: DirectoryCore, group: GroupId) -> str:
    reply = core.handle(m.Evict(groups=[group]), 0).reply
    assert isinstance(reply, m.EvictReply)
    return reply.results[0].status


def test_a_batch_releases_the_holders_leases_and_skips_the_rest() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    put(core, [key(g)])
    mine = [lookup(core, [g]).lease_id for _ in range(3)]
    theirs = lookup(core, [g], holder="other").lease_id
    pin = core.handle(m.Pin(holder_id="reader", groups=[g.group_id()], ttl_ms=1000), 0).reply
    assert isinstance(pin, m.PinReply) and pin.pin_id

    asked = [mine[0], theirs, mine[1], 10**9, pin.pin_id, mine[1]]  # foreign, unknown, a pin, twice
    assert release(core, "reader", asked).released == [mine[0], mine[1]]
    core.check_invariants()
    # held by the pin (answered first: the policy backs off from pins only), mine[2] and theirs
    assert evict_status(core, g.group_id()) == "pinned"

    assert release(core, "reader", [mine[2]]).released == [mine[2]]
    assert release(core, "reader", mine).released == []  # retried: nothing left, no error
    assert release(core, "other", [theirs]).released == [theirs]
    assert evict_status(core, g.group_id()) == "pinned"  # a batch of leases never ends a pin
    core.handle(m.Unpin(holder_id="reader", pin_id=pin.pin_id), 0)
    assert evict_status(core, g.group_id()) == "evicting"  # nothing holds it any more
    core.check_invariants()


def test_a_batch_is_bounded_and_names_its_leases_in_one_field() -> None:
    core = new_core()
    register(core, "s1")
    with pytest.raises(BatchTooLarge):
        release(core, "reader", list(range(1, m.RELEASE_BATCH_LEASES_MAX + 2)))
    assert release(core, "reader", list(range(1, m.RELEASE_BATCH_LEASES_MAX + 1))).released == []
    with pytest.raises(BadRequest, match="lease_ids only"):
        core.handle(m.LeaseRelease(holder_id="reader", lease_id=1, lease_ids=[2]), 0)


def test_the_single_form_is_unchanged_and_its_old_encoding_decodes() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = groups(1)
    put(core, [key(g)])
    lease_id = lookup(core, [g]).lease_id
    old = msgspec.msgpack.encode(  # as a client from before `lease_ids` encodes it
        {"t": "dir.lease_release.v1", "holder_id": "reader", "lease_id": lease_id, "epoch": 0, "shard": 0}
    )
    request = m.request_decoder.decode(old)
    assert request == m.LeaseRelease(holder_id="reader", lease_id=lease_id)
    assert core.handle(request, 0).reply == m.LeaseReply(epoch=core.epoch, lease_id=lease_id, expires_ms=0)
    with pytest.raises(NotFound):
        core.handle(request, 0)
    # A directory from before the batch ignores `lease_ids` and sees lease 0: `not_found`, which
    # tells the client to release one by one.
    with pytest.raises(NotFound):
        core.handle(m.LeaseRelease(holder_id="reader", lease_id=0), 0)

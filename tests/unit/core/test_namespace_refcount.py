"""Interned namespaces (`NamespaceTable`) are counted by the published and evicting records naming
them, dropped with the last and their index reused. Before (review) none was ever dropped: the
namespace is the tenant's to choose (a fresh model id a save), so saving and evicting 1-byte
groups grew the table without bound (+6 MB per 10,000). `check_invariants` recounts them."""

from __future__ import annotations

from kvfabric.core.directory import DirectoryCore, FreeSlots, Outcome
from kvfabric.core.directory.keys import parse_group
from kvfabric.core.directory.records import unpack_group
from kvfabric.format.key import ChunkGroupId, ModelFingerprint, chunk_groups_for_prefix
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import DOMAIN, key, layout, lookup, new_core, put, register


def group_of_model(i: int, chunks: int = 1) -> list[ChunkGroupId]:
    model = ModelFingerprint(model_id=f"m{i}", weights_revision="r", kv_dtype="f", attn_config_digest="a")
    return chunk_groups_for_prefix(DOMAIN, model, layout(), list(range(4 * chunks)))


def ack_frees(core: DirectoryCore, out: Outcome, now: int = 0) -> None:
    for e in out.effects:
        if isinstance(e, FreeSlots):
            core.handle(
                m.SlotsFreed(segment_id=e.segment_id, incarnation=e.incarnation, freed=list(e.slots)), now
            )


def evict(core: DirectoryCore, gs: list[ChunkGroupId]) -> Outcome:
    out = core.handle(m.Evict(groups=[g.group_id() for g in gs], reason="tenant"), 0)
    assert isinstance(out.reply, m.EvictReply)
    assert {r.status for r in out.reply.results} == {"evicting"}
    return out


def namespace_index(core: DirectoryCore, g: ChunkGroupId) -> int:
    """The namespace index in `g`'s published record."""
    return unpack_group(core.published[parse_group(g.group_id()).group_id]).namespace


def test_the_namespaces_of_evicted_groups_are_dropped() -> None:
    core = new_core()
    register(core, "s1", capacity=1 << 30)
    gs = [group_of_model(i)[0] for i in range(100)]  # 100 namespaces, one group each
    put(core, [key(g) for g in gs], size=1)
    assert len(core.published_table.namespaces) == 100
    out = evict(core, gs)
    core.check_invariants()
    assert len(core.published_table.namespaces) == 100  # the evicting records still name them
    ack_frees(core, out)
    core.check_invariants()
    assert not core.published and not core.evicting
    assert len(core.published_table.namespaces) == 0


def test_a_namespace_stays_while_a_record_names_it_and_its_index_is_reused() -> None:
    core = new_core()
    register(core, "s1", capacity=1 << 30)
    a0, a1 = group_of_model(0, chunks=2)  # one namespace, two groups
    (b,) = group_of_model(1)
    put(core, [key(a0), key(a1), key(b)], size=1)
    assert len(core.published_table.namespaces) == 2
    ack_frees(core, evict(core, [a1]))  # a0 still names it
    core.check_invariants()
    assert len(core.published_table.namespaces) == 2
    hit = lookup(core, [a0])
    assert hit.hit_chunks == 1
    core.handle(m.LeaseRelease(holder_id="reader", lease_id=hit.lease_id), 0)
    shown = core.handle(m.ShowGroup(group=a0.group_id()), 0).reply
    assert isinstance(shown, m.GroupList)
    assert shown.groups[0].namespace == parse_group(a0.group_id()).namespace
    freed = namespace_index(core, a0)
    ack_frees(core, evict(core, [a0]))
    core.check_invariants()
    assert len(core.published_table.namespaces) == 1  # b's only
    (c,) = group_of_model(2)
    put(core, [key(c)], size=1, request_id="r2")
    core.check_invariants()
    assert len(core.published_table.namespaces) == 2
    assert namespace_index(core, c) == freed  # a new namespace takes the freed index
    assert lookup(core, [b]).hit_chunks == lookup(core, [c]).hit_chunks == 1
    assert lookup(core, [a0]).hit_chunks == 0  # gone (its old index names c's namespace now)


def test_an_invalidated_groups_namespace_is_dropped() -> None:
    core = new_core()
    register(core, "s1")
    (g,) = group_of_model(0)
    put(core, [key(g)], size=1)  # its only replica on s1
    register(core, "s2")
    for t in range(1_000, 7_001, 1_000):  # s1 goes silent: declared down, the group swept
        core.handle(m.Heartbeat(segment_id="s2", incarnation=1, used_bytes=0), t)
        core.tick(t)
        core.check_invariants()
    assert not core.published
    assert len(core.published_table.namespaces) == 0

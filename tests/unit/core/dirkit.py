"""Helpers for directory-core tests: keys, segments, and short request builders."""

from __future__ import annotations

from typing import Any

import xxhash

from kvfabric.core.directory import DirectoryConfig, DirectoryCore, Outcome
from kvfabric.format.ids import ObjectKey
from kvfabric.format.key import (
    ChunkGroupId,
    KVKey,
    KVLayout,
    ModelFingerprint,
    ShareDomain,
    chunk_groups_for_prefix,
)
from kvfabric.proto import directory as m

SECRET = b"test-cluster-secret-0123456789"
DOMAIN = ShareDomain(tenant_id="tenant-a", salt=b"s" * 16)
MODEL = ModelFingerprint(
    model_id="tiny-llama", weights_revision="r1", kv_dtype="float32", attn_config_digest="rope"
)


def layout(tp_size: int = 1, layer_group_count: int = 1) -> KVLayout:
    return KVLayout(
        tp_size=tp_size,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=layer_group_count,
        tokens_per_chunk=4,
        tensor_layout="test",
    )


def groups(n_chunks: int, seed: int = 0, tp_size: int = 1, layer_group_count: int = 1) -> list[ChunkGroupId]:
    tokens = [seed * 1000 + i for i in range(4 * n_chunks)]
    return chunk_groups_for_prefix(DOMAIN, MODEL, layout(tp_size, layer_group_count), tokens)


def key(group: ChunkGroupId, rank: int = 0, lgroup: int = 0) -> ObjectKey:
    return KVKey(chunk_group=group, tp_rank=rank, pp_stage=0, layer_group=lgroup).object_key()


def checksum_of(k: bytes) -> bytes:
    return xxhash.xxh3_128_digest(k)


def spec(k: ObjectKey, size: int = 100) -> m.ObjectSpec:
    return m.ObjectSpec(key=k, size_bytes=size, checksum=checksum_of(k))


def new_core(**overrides: Any) -> DirectoryCore:
    return DirectoryCore(DirectoryConfig(ticket_secret=SECRET, **overrides))


def register(
    core: DirectoryCore,
    seg: str,
    now: int = 0,
    incarnation: int = 1,
    capacity: int = 10_000,
    host: str | None = None,
    rack: str = "rack0",
    zone: str = "zone0",
) -> Outcome:
    return core.handle(
        m.RegisterSegment(
            segment_id=seg,
            incarnation=incarnation,
            capacity_bytes=capacity,
            domain=m.FailureDomain(host=host or seg, rack=rack, zone=zone),
            data_addr=f"tcp://{seg}",
        ),
        now,
    )


def confirm_ticket(core: DirectoryCore, t: m.WriteTicket, slot: int, now: int) -> Outcome:
    """The ticket's segment confirms what it stored for it at (`slot`, generation 1)."""
    confirm = m.ReplicaConfirm(
        ticket_id=t.ticket_id,
        key=t.key,
        slot=slot,
        slot_generation=1,
        size_bytes=t.size_bytes,
        checksum=t.checksum,
    )
    return core.handle(
        m.ConfirmReplicas(segment_id=t.segment_id, incarnation=t.incarnation, confirms=[confirm]), now
    )


def confirm_all(core: DirectoryCore, reply: m.PutBeginReply, now: int, slot_base: int = 0) -> None:
    for i, res in enumerate(reply.results):
        for t in res.tickets:
            confirm_ticket(core, t, slot_base + i, now)


def put(
    core: DirectoryCore,
    keys: list[ObjectKey],
    writer: str = "w1",
    now: int = 0,
    request_id: str = "r1",
    size: int = 100,
) -> m.PutCommitReply:
    begin = core.handle(
        m.PutBegin(writer_id=writer, request_id=request_id, objects=[spec(k, size) for k in keys]), now
    ).reply
    assert isinstance(begin, m.PutBeginReply)
    confirm_all(core, begin, now)
    commit = core.handle(m.PutCommit(writer_id=writer, request_id=request_id + "c", keys=keys), now).reply
    assert isinstance(commit, m.PutCommitReply)
    return commit


def one_group_and_a_copy_target(core: DirectoryCore) -> tuple[ChunkGroupId, str]:
    """Segments s1 and s2, one group published on one of them: the group and the other segment
    (where a copy of it may go)."""
    register(core, "s1")
    register(core, "s2")
    (g,) = groups(1)
    put(core, [key(g)])
    there = lookup(core, [g]).objects[0].replicas[0].segment_id
    return g, "s2" if there == "s1" else "s1"


def lookup(
    core: DirectoryCore, gs: list[ChunkGroupId], now: int = 0, holder: str = "reader", ttl: int = 1000
) -> m.LookupReply:
    reply = core.handle(
        m.Lookup(holder_id=holder, groups=[g.group_id() for g in gs], lease_ttl_ms=ttl), now
    ).reply
    assert isinstance(reply, m.LookupReply)
    return reply

"""Promotion by a prefetch hint (issue 23 step 4): a prefix demoted to a segment's disk tier
(`demote.<segment>`), then hinted with that segment as the target: the prefetch service copies
every object from the disk replica into the arena (the segment reads its own disk), lookups list
the arena replica first, the client loads identical bytes, and the segment counts promotions.
The disk replicas stay (they survive a restart)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient

from kvfabric.cluster.requests import request as nats_request
from kvfabric.format.key import KVKey, chunk_groups_for_prefix
from kvfabric.proto import directory as m
from kvfabric.proto import prefetch as p
from kvfabric.proto.segment import DemoteObject, DemoteReply, DemoteRequest, segment_decoder, tier_of_slot
from kvfabric.proto.subjects import Service, endpoint_subject, segment_subject
from kvfabric.testing import NatsServer, metric_value, scrape_metrics
from tests.integration.clientkit import SPEC, TOKENS_PER_CHUNK, client, objects_for, prompt
from tests.integration.cluster import directory_call, directory_process, prefetch_process, segment_process
from tests.integration.test_ssd_demotion import loaded_identical, ssd_env, tiers

pytestmark = pytest.mark.integration

SEGMENT = "seg-promote"
CHUNKS = 8


async def demote_all(nc: NatsClient, tokens: list[int]) -> list[str]:
    """Every object of the prefix moved to the segment's disk tier; the statuses."""
    statuses: list[str] = []
    for g in chunk_groups_for_prefix(SPEC.domain, SPEC.model, SPEC.layout, tokens):
        shown = await directory_call(nc, "show_group", m.ShowGroup(group=g.to_bytes()))
        assert isinstance(shown, m.GroupList)
        objects = [
            DemoteObject(
                KVKey(
                    chunk_group=g,
                    tp_rank=o.member.tp_rank,
                    pp_stage=o.member.pp_stage,
                    layer_group=o.member.layer_group,
                ).object_key(),
                r.slot,
                r.slot_generation,
            )
            for o in shown.groups[0].objects
            for r in o.replicas
            if tier_of_slot(r.slot) == "dram"
        ]
        reply = await nats_request(
            nc, segment_subject(SEGMENT, "demote"), DemoteRequest(objects=objects), segment_decoder, 30.0
        )
        assert isinstance(reply, DemoteReply)
        statuses += [r.status for r in reply.results]
    return statuses


async def shown_tiers(url: str, tokens: list[int]) -> list[set[str]]:
    """Per chunk, the tiers of its replicas, from `show_group` (no lease, no hit counted)."""
    nc = await nats.connect(url)
    try:
        out: list[set[str]] = []
        for g in chunk_groups_for_prefix(SPEC.domain, SPEC.model, SPEC.layout, tokens):
            shown = await directory_call(nc, "show_group", m.ShowGroup(group=g.to_bytes()))
            assert isinstance(shown, m.GroupList)
            out.append({tier_of_slot(r.slot) for o in shown.groups[0].objects for r in o.replicas})
        return out
    finally:
        await nc.close()


async def hint(nc: NatsClient, tokens: list[int]) -> p.HintReply:
    groups = chunk_groups_for_prefix(SPEC.domain, SPEC.model, SPEC.layout, tokens)
    message = p.PrefetchHint(
        hint_id="promote-1",
        tenant="tenant-a",
        groups=[g.group_id() for g in groups],
        target_segment=SEGMENT,
        deadline_ms=time.time_ns() // 1_000_000 + 20_000,
    )
    reply = await nats_request(
        nc,
        endpoint_subject(Service.PREFETCH, "hint"),
        message,
        p.prefetch_decoder,
        5.0,
    )
    assert isinstance(reply, p.HintReply)
    return reply


def test_a_prefetch_hint_promotes_a_demoted_prefix_into_the_arena(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    tokens = prompt(CHUNKS * TOKENS_PER_CHUNK, seed=77)
    with (
        directory_process(nats_server),
        segment_process(nats_server, SEGMENT, 64 << 20, **ssd_env(tmp_path / "ssd", 64 << 20)) as segment,
        prefetch_process(nats_server, KVF_PREFETCH_TICK_MS="20"),
        client(nats_server) as kv,
    ):
        assert kv.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS

        async def with_nats(step: str) -> object:
            nc = await nats.connect(nats_server.url)
            try:
                return await (demote_all(nc, tokens) if step == "demote" else hint(nc, tokens))
            finally:
                await nc.close()

        assert asyncio.run(with_nats("demote")) == ["demoted"] * CHUNKS
        assert tiers(kv, tokens) == [{"ssd"}] * CHUNKS
        assert loaded_identical(kv, tokens) == CHUNKS  # from disk
        reply = asyncio.run(with_nats("hint"))
        assert isinstance(reply, p.HintReply)
        assert reply.status == "accepted" and reply.objects_queued == CHUNKS  # on disk only: wanted in DRAM
        deadline = time.monotonic() + 20
        while tiers(kv, tokens) != [{"dram", "ssd"}] * CHUNKS:
            assert time.monotonic() < deadline, tiers(kv, tokens)
            time.sleep(0.1)
        hit = kv.lookup(tokens)
        assert all(tier_of_slot(chunk[0].replicas[0].slot) == "dram" for chunk in hit.objects)  # DRAM first
        kv.release(hit)
        assert loaded_identical(kv, tokens) == CHUNKS
        started = segment.wait_for_event("segment_started", 1.0)
        text = scrape_metrics(started["metrics_port"])
        assert metric_value(text, "kvfabric_segment_tier_moves_total", direction="promotion") == CHUNKS
        assert metric_value(text, "kvfabric_segment_tier_moves_total", direction="demotion") == CHUNKS
        assert metric_value(text, "kvfabric_segment_tier_objects", tier="ssd") == CHUNKS


def test_a_hot_prefix_on_disk_gets_an_arena_copy_that_goes_when_it_cools(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Reads of a prefix held on disk only make the prefetch service place hot extra replicas in
    the segment's own arena; once cold, the extras go and the disk replicas stay."""
    tokens = prompt(4 * TOKENS_PER_CHUNK, seed=951)
    with (
        directory_process(nats_server),
        segment_process(nats_server, SEGMENT, 64 << 20, **ssd_env(tmp_path / "ssd", 64 << 20)),
        prefetch_process(
            nats_server,
            KVF_PREFETCH_HOT_READS_PER_S="5",
            KVF_PREFETCH_COLD_READS_PER_S="1",
            KVF_PREFETCH_HOT_WINDOW_MS="2000",
            KVF_PREFETCH_SCAN_MS="200",
        ),
        client(nats_server) as kv,
    ):
        assert kv.save(tokens, objects_for(tokens, 0, 4)).chunks_saved == 4

        async def demote() -> list[str]:
            nc = await nats.connect(nats_server.url)
            try:
                return await demote_all(nc, tokens)
            finally:
                await nc.close()

        assert asyncio.run(demote()) == ["demoted"] * 4
        deadline = time.monotonic() + 20
        while tiers(kv, tokens) != [{"dram", "ssd"}] * 4:  # hot: read and read again
            assert time.monotonic() < deadline, tiers(kv, tokens)
            for _ in range(10):
                kv.release(kv.lookup(tokens))
            time.sleep(0.05)
        assert loaded_identical(kv, tokens) == 4
        deadline = time.monotonic() + 20
        while asyncio.run(shown_tiers(nats_server.url, tokens)) != [{"ssd"}] * 4:  # no reads: cold
            assert time.monotonic() < deadline, asyncio.run(shown_tiers(nats_server.url, tokens))
            time.sleep(0.2)
        assert loaded_identical(kv, tokens) == 4  # the disk replicas stayed

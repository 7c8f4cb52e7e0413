"""The eviction-policy service on a live cluster: past the high watermark it evicts down to the
low watermark, tails before heads, while a reader holding a lease keeps reading identical bytes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import nats
import pytest
from typer.testing import CliRunner

from kvfabric.client import Hit, KvClient
from kvfabric.cluster.requests import request as nats_request
from kvfabric.ctl.cli import app
from kvfabric.ctl.queries import EVENTS_STREAM
from kvfabric.format.errors import BadRequest
from kvfabric.format.ids import GroupId, GroupKey
from kvfabric.proto import directory as m
from kvfabric.proto import eviction as e
from kvfabric.proto.subjects import Service, endpoint_subject, event_subject
from kvfabric.testing import NatsServer, ServiceProcess
from tests.integration.clientkit import (
    CHUNK_BYTES,
    TOKENS_PER_CHUNK,
    chunk_bytes,
    client,
    objects_for,
    prompt,
)
from tests.integration.cluster import (
    directory_call,
    directory_process,
    eviction_process,
    eviction_status,
    segment_process,
)

pytestmark = pytest.mark.integration

ARENA_BYTES = 8 << 20  # 128 chunks of 64 KiB
HIGH_PCT, LOW_PCT = 50, 30
CHUNKS_PER_PROMPT = 8


@pytest.fixture
def cluster(nats_server: NatsServer) -> Iterator[None]:
    with directory_process(nats_server), segment_process(nats_server, "seg-ev", arena_bytes=ARENA_BYTES):
        yield


def policy_process(nats_server: NatsServer, policy: str) -> contextlib.AbstractContextManager[ServiceProcess]:
    return eviction_process(
        nats_server,
        KVF_EVICTION_POLICY=policy,
        KVF_EVICTION_HIGH_WATERMARK_PCT=str(HIGH_PCT),
        KVF_EVICTION_LOW_WATERMARK_PCT=str(LOW_PCT),
        KVF_EVICTION_TICK_MS="50",
        KVF_EVICTION_SEGMENTS_REFRESH_MS="200",
        KVF_EVICTION_REFUSED_COOLDOWN_MS="200",
    )


async def published_chunks(nats_url: str) -> dict[bytes, set[int]]:
    """Chain hash -> chunk index of every published group (paged through `list_groups`)."""
    nc = await nats.connect(nats_url)
    out: dict[bytes, set[int]] = {}
    try:
        after = GroupKey(b"")
        while True:
            reply = await directory_call(nc, "list_groups", m.ListGroups(after=after, limit=1000))
            assert isinstance(reply, m.GroupList)
            for g in reply.groups:
                out.setdefault(g.group, set()).add(g.chunk_index)
            if not reply.next_after:
                return out
            after = reply.next_after
    finally:
        await nc.close()


async def accessed_in_stream(url: str, timeout_s: float = 10.0) -> None:
    """Until the events stream holds a lookup's hit (`accessed`, batched: the directory's next
    tick sends it). Saved before it, other prompts would be older than the looked-up one in the
    policy's view, and LRU would never ask for the leased prompt (a CI run under load)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        subject = event_subject(Service.DIRECTORY, "accessed")
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not (await js.stream_info(EVENTS_STREAM, subjects_filter=subject)).state.subjects:
            assert asyncio.get_running_loop().time() < deadline, "no accessed event in the stream"
            await asyncio.sleep(0.05)
    finally:
        await nc.close()


def read_loop(reader: KvClient, hit: Hit, tokens: list[int], stop: threading.Event, errors: list[str]) -> int:
    """Load the leased prefix again and again; every byte must match. Returns loads done."""
    loads = 0
    while not stop.is_set():
        out = [[bytearray(CHUNK_BYTES)] for _ in range(CHUNKS_PER_PROMPT)]
        result = reader.load(hit, out)
        if result.tokens != CHUNKS_PER_PROMPT * TOKENS_PER_CHUNK:
            errors.append(f"leased load came back short: {result.tokens} tokens, cause {result.cause}")
        for c in range(result.tokens // TOKENS_PER_CHUNK):
            if bytes(out[c][0]) != chunk_bytes(tokens, c):
                errors.append(f"wrong bytes in chunk {c}")
        loads += 1
    reader.release(hit)
    return loads


@pytest.mark.parametrize("policy", ["lru", "gdsf", "lru2", "sieve", "s3fifo", "wtinylfu", "reuse", "density"])
def test_past_the_high_watermark_it_evicts_to_the_low_one_and_leased_reads_stay_intact(
    nats_server: NatsServer, cluster: None, policy: str
) -> None:
    prompts = [prompt(CHUNKS_PER_PROMPT * TOKENS_PER_CHUNK, seed=100 + i) for i in range(10)]
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(client(nats_server))
        reader = stack.enter_context(client(nats_server))
        assert writer.save(prompts[0], objects_for(prompts[0], 0, CHUNKS_PER_PROMPT)).chunks_saved == 8
        leased = reader.lookup(prompts[0])  # leased, and looked up before the others are written
        assert leased.chunks == CHUNKS_PER_PROMPT
        asyncio.run(accessed_in_stream(nats_server.url))
        stop, errors = threading.Event(), list[str]()
        loads: list[int] = []
        thread = threading.Thread(
            target=lambda: loads.append(read_loop(reader, leased, prompts[0], stop, errors)), daemon=True
        )
        thread.start()
        # 10 prompts x 8 chunks x 64 KiB = 5 MiB: 62.5 % of the arena, past the 50 % mark. The
        # policy starts afterwards: it replays the directory's events, then evicts in one go (with
        # no write racing it, it must end exactly at the low watermark).
        for tokens in prompts[1:]:
            saved = writer.save(tokens, objects_for(tokens, 0, CHUNKS_PER_PROMPT))
            assert saved.chunks_failed == 0
        saved_groups = group_ids(nats_server.url)
        assert len(saved_groups) == len(prompts) * CHUNKS_PER_PROMPT
        stack.enter_context(policy_process(nats_server, policy))

        last: list[e.EvictionStatus] = []

        async def settled() -> e.EvictionStatus:
            while True:
                st = await eviction_status(nats_server.url)
                last[:] = [st]
                if not st.pools:  # still replaying the stream / learning the segment
                    await asyncio.sleep(0.1)
                    continue
                (pool,) = st.pools
                if st.counters.get("evicted_total", 0) and pool.used_bytes <= LOW_PCT / 100 * ARENA_BYTES:
                    # ... and the policy has applied every event: it tracks what the directory has
                    chunks = await published_chunks(nats_server.url)
                    if sum(len(c) for c in chunks.values()) * CHUNK_BYTES == pool.used_bytes:
                        return st
                await asyncio.sleep(0.1)

        try:
            final = asyncio.run(asyncio.wait_for(settled(), 30.0))
        except TimeoutError:
            raise AssertionError(f"never settled: {last}") from None
        stop.set()
        thread.join(30.0)
        assert not errors, errors[:5]
        assert loads and loads[0] > 0
        (pool,) = final.pools
        assert pool.capacity_bytes == ARENA_BYTES
        # Down to the low watermark, not much further: it stops within one chunk of it.
        assert LOW_PCT / 100 * ARENA_BYTES - CHUNK_BYTES < pool.used_bytes <= LOW_PCT / 100 * ARENA_BYTES

        # The directory agrees, and every prompt kept a head (chunks 0..k-1): tails went first.
        chunks = asyncio.run(published_chunks(nats_server.url))
        assert sum(len(c) for c in chunks.values()) * CHUNK_BYTES == pool.used_bytes
        with client(nats_server) as probe:
            kept = []
            for tokens in prompts:
                hit = probe.lookup(tokens)
                kept.append(hit.tokens // TOKENS_PER_CHUNK)
                probe.release(hit)
        assert kept[0] == CHUNKS_PER_PROMPT, "the leased prompt was evicted under its reader"
        if final.policy == "lru":  # the leased prompt is the least recently looked up: asked, refused
            assert final.counters.get("evict_refused_total", 0) >= 1, final.counters
        assert sum(kept) * CHUNK_BYTES == pool.used_bytes, f"a tail outlived its head: kept {kept}"
        if policy == "lru":
            explained_by_kvctl(nats_server.url, saved_groups)


def group_ids(url: str) -> set[str]:
    """Every published chunk group's id (hex), as `kvctl objects ls` lists them."""
    result = CliRunner().invoke(app, ["objects", "ls", "--json", "--limit", "1000", "--nats-url", url])
    assert result.exit_code == 0, result.output
    return {g["group_id"] for g in json.loads(result.stdout)["groups"]}


def explained_by_kvctl(url: str, saved: set[str]) -> None:
    """`kvctl eviction explain` says why a group was evicted (chosen as least recent at the
    watermark, then evicted) and what the policy ranks a kept one by; `status` shows the pool."""
    kept = group_ids(url)
    evicted = saved - kept
    assert kept and evicted

    def kvctl(*args: str) -> Any:
        result = CliRunner().invoke(app, [*args, "--json", "--nats-url", url])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    gone = kvctl("eviction", "explain", sorted(evicted)[0])
    assert gone["policy"] == "lru" and not gone["tracked"] and not gone["features"]
    assert [(d["what"], d["reason"], d["cause"]) for d in gone["decisions"]] == [
        ("tracked", "always", ""),
        ("chosen", "least_recent", "watermark"),
        ("evicted", "evicting", "watermark"),
    ]
    stays = kvctl("eviction", "explain", sorted(kept)[0])
    assert stays["tracked"] and stays["features"]["bytes"] == CHUNK_BYTES
    assert stays["decisions"][0]["what"] == "tracked" and stays["decisions"][0]["pool"] == "seg-ev"
    status = kvctl("eviction", "status")
    assert status["policy"] == "lru" and status["pools"][0]["segment_id"] == "seg-ev"
    text = CliRunner().invoke(app, ["eviction", "explain", sorted(evicted)[0], "--nats-url", url])
    assert text.exit_code == 0 and "least_recent" in text.stdout and "watermark" in text.stdout, text.output
    missing = CliRunner().invoke(app, ["eviction", "explain", "kvg1:nonsense", "--nats-url", url])
    assert missing.exit_code == 2, missing.output

    async def short_id() -> None:  # past kvctl's own parsing: the service answers a typed error
        nc = await nats.connect(url)
        try:
            with pytest.raises(BadRequest, match="90 bytes"):
                await nats_request(
                    nc,
                    endpoint_subject(Service.EVICTION, "explain"),
                    e.EvictionExplainRequest(group_id=GroupId(bytes(89))),
                    e.eviction_decoder,
                    5.0,
                )
        finally:
            await nc.close()

    asyncio.run(short_id())


def test_a_policy_started_after_its_events_aged_out_adopts_the_directorys_listing(
    nats_server: NatsServer, cluster: None
) -> None:
    """The stream lost every event (purged, as its retention would): the policy adopts the
    published groups from the directory's listing and evicts them down to the low watermark
    (before this, it tracked nothing and the segment stayed full for good)."""
    prompts = [prompt(CHUNKS_PER_PROMPT * TOKENS_PER_CHUNK, seed=300 + i) for i in range(10)]
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(client(nats_server))
        for tokens in prompts:  # 62.5 % of the arena
            assert writer.save(tokens, objects_for(tokens, 0, CHUNKS_PER_PROMPT)).chunks_failed == 0
        saved = group_ids(nats_server.url)
        assert len(saved) == len(prompts) * CHUNKS_PER_PROMPT

        async def purge() -> None:
            nc = await nats.connect(nats_server.url)
            try:
                await nc.jetstream().purge_stream(EVENTS_STREAM)
            finally:
                await nc.close()

        asyncio.run(purge())
        stack.enter_context(policy_process(nats_server, "lru"))

        async def settled() -> e.EvictionStatus:
            while True:
                st = await eviction_status(nats_server.url)
                if st.pools and st.counters.get("evicted_total", 0):
                    chunks = await published_chunks(nats_server.url)
                    if sum(len(c) for c in chunks.values()) * CHUNK_BYTES == st.pools[0].used_bytes:
                        return st
                await asyncio.sleep(0.1)

        final = asyncio.run(asyncio.wait_for(settled(), 30.0))
        assert final.counters["groups_adopted_total"] == len(saved), final.counters
        (pool,) = final.pools
        assert LOW_PCT / 100 * ARENA_BYTES - CHUNK_BYTES < pool.used_bytes <= LOW_PCT / 100 * ARENA_BYTES
        kept = group_ids(nats_server.url)
        assert kept < saved and kept
        result = CliRunner().invoke(
            app, ["eviction", "explain", sorted(kept)[0], "--json", "--nats-url", nats_server.url]
        )
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["decisions"][0]["reason"] == "listed"


def test_a_pinned_prefix_goes_once_its_pin_is_removed_not_after_the_backoff(
    nats_server: NatsServer, cluster: None
) -> None:
    """A victim refused as pinned is not asked again for `refused_cooldown_ms` (here 30 s),
    doubled per refusal in a row. The directory's `unpinned` event (stop 65) ends that wait:
    once the pin is removed, the pool is back at its low watermark within seconds."""
    prompts = [prompt(CHUNKS_PER_PROMPT * TOKENS_PER_CHUNK, seed=300 + i) for i in range(10)]
    with client(nats_server) as writer:
        for tokens in prompts:  # 62.5 % of the arena, past the 50 % mark
            assert writer.save(tokens, objects_for(tokens, 0, CHUNKS_PER_PROMPT)).chunks_failed == 0
    runner = CliRunner()
    every_group = sorted(group_ids(nats_server.url))
    added = runner.invoke(
        app, ["pins", "add", *every_group, "--ttl-ms", "600000", "--json", "--nats-url", nats_server.url]
    )
    assert added.exit_code == 0, added.output
    pin = json.loads(added.stdout)
    assert pin["pinned_groups"] == len(prompts) * CHUNKS_PER_PROMPT
    policy = eviction_process(
        nats_server,
        KVF_EVICTION_POLICY="lru",
        KVF_EVICTION_HIGH_WATERMARK_PCT=str(HIGH_PCT),
        KVF_EVICTION_LOW_WATERMARK_PCT=str(LOW_PCT),
        KVF_EVICTION_TICK_MS="50",
        KVF_EVICTION_SEGMENTS_REFRESH_MS="200",
        KVF_EVICTION_REFUSED_COOLDOWN_MS="30000",
    )
    with policy:
        last: list[e.EvictionStatus] = []

        async def until(done: Any, timeout_s: float) -> e.EvictionStatus:
            async def poll() -> e.EvictionStatus:
                while True:
                    st = await eviction_status(nats_server.url)
                    last[:] = [st]
                    if done(st):
                        return st
                    await asyncio.sleep(0.1)

            try:
                return await asyncio.wait_for(poll(), timeout_s)
            except TimeoutError:
                raise AssertionError(f"not reached in {timeout_s} s: {last}") from None

        refused = asyncio.run(until(lambda st: st.counters.get("evict_refused_total", 0) >= 1, 30.0))
        assert not refused.counters.get("evicted_total", 0)  # everything is pinned
        for shard in pin.get("shards", [pin]):  # one pin per directory shard the groups fall in
            if shard["pin_id"]:
                args = ["pins", "rm", str(shard["pin_id"]), "--shard", str(shard["shard"])]
                removed = runner.invoke(app, [*args, "--nats-url", nats_server.url])
                assert removed.exit_code == 0, removed.output
        settled = asyncio.run(
            until(
                lambda st: bool(st.pools) and st.pools[0].used_bytes <= LOW_PCT / 100 * ARENA_BYTES,
                10.0,  # a third of the first refusal's cooldown: the policy did not wait for it
            )
        )
        assert settled.counters.get("unpinned_woken_total", 0) >= 1, settled.counters
        assert settled.counters.get("evicted_total", 0) > 0

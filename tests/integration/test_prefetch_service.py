"""The prefetch service on a live cluster: a hint sent ahead moves a prefix onto the engine's
local segment, so the later load is served there (it even survives the remote segment hanging);
cancelled hints release their leases; a flood of 10,000 hints is absorbed with `busy` answers
while normal loads keep working."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import time

import msgspec
import nats
import pytest

from kvfabric.cluster.requests import request as nats_request
from kvfabric.format.clock import now_ms
from kvfabric.format.errors import BadRequest
from kvfabric.format.key import chunk_groups_for_prefix
from kvfabric.proto import directory as m
from kvfabric.proto import prefetch as p
from kvfabric.proto.subjects import Service, endpoint_subject
from kvfabric.testing import NatsServer
from tests.integration.clientkit import SPEC, TOKENS_PER_CHUNK, chunk_bytes, client, objects_for, prompt
from tests.integration.cluster import directory_call, directory_process, prefetch_process, segment_process

pytestmark = pytest.mark.integration

CHUNKS = 8
LOCAL, REMOTE = "seg-local", "seg-remote"


async def ask(url: str, verb: str, message: msgspec.Struct) -> object:
    nc = await nats.connect(url)
    try:
        reply: object = await nats_request(
            nc,
            endpoint_subject(Service.PREFETCH, verb),
            message,
            p.prefetch_decoder,  # type: ignore[arg-type]
            5.0,
        )
        return reply
    finally:
        await nc.close()


def hint_for(tokens: list[int], hint_id: str, deadline_s: float = 20.0) -> p.PrefetchHint:
    groups = chunk_groups_for_prefix(SPEC.domain, SPEC.model, SPEC.layout, tokens)
    return p.PrefetchHint(
        hint_id=hint_id,
        tenant="tenant-a",
        groups=[g.group_id() for g in groups],
        target_segment=LOCAL,
        deadline_ms=now_ms() + int(deadline_s * 1000),
    )


async def replicas_on(url: str, tokens: list[int], segment: str) -> int:
    """Chunks of `tokens` with a replica on `segment`."""
    nc = await nats.connect(url)
    try:
        n = 0
        for g in chunk_groups_for_prefix(SPEC.domain, SPEC.model, SPEC.layout, tokens):
            shown = await directory_call(nc, "show_group", m.ShowGroup(group=g.to_bytes()))
            assert isinstance(shown, m.GroupList)
            n += any(r.segment_id == segment for o in shown.groups[0].objects for r in o.replicas)
        return n
    finally:
        await nc.close()


def timed_load(kv: object, tokens: list[int]) -> tuple[float, int, bool]:
    started = time.perf_counter()
    hit = kv.lookup(tokens)  # type: ignore[attr-defined]
    out = [[bytearray(64 << 10)] for _ in range(hit.chunks)]
    result = kv.load(hit, out)  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - started
    kv.release(hit)  # type: ignore[attr-defined]
    n = result.tokens // TOKENS_PER_CHUNK
    return elapsed, n, all(bytes(out[c][0]) == chunk_bytes(tokens, c) for c in range(n))


def test_a_hinted_prefix_is_loaded_from_the_local_segment(nats_server: NatsServer) -> None:
    prompts = [prompt(CHUNKS * TOKENS_PER_CHUNK, seed=700 + i) for i in range(12)]
    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(directory_process(nats_server))
        remote = stack.enter_context(segment_process(nats_server, REMOTE, KVF_SEGMENT_ZONE="zr"))
        with client(nats_server) as writer:  # only the remote segment exists: everything lands there
            for tokens in prompts:
                assert writer.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        stack.enter_context(segment_process(nats_server, LOCAL, KVF_SEGMENT_ZONE="zl"))
        prefetch = stack.enter_context(prefetch_process(nats_server))
        engine = stack.enter_context(client(nats_server, local_segments=LOCAL, load_timeout_ms=1_500))
        hinted, unhinted = prompts[:6], prompts[6:]
        for i, tokens in enumerate(hinted):
            reply = asyncio.run(ask(nats_server.url, "hint", hint_for(tokens, f"req-{i}")))
            accepted = isinstance(reply, p.HintReply) and reply.status == "accepted"
            if not (accepted and reply.objects_queued == CHUNKS):  # type: ignore[attr-defined]
                # Seen once under full-suite load (accepted, 0 queued: the prefetch's lookup
                # missed): say what an engine sees now and what the services logged.
                hit = engine.lookup(tokens)
                engine.release(hit)
                logged = [
                    {k: e.get(k) for k in ("event", "shard", "segment_id", "reason", "error")}
                    for proc in (directory, remote, prefetch)
                    for e in proc.events()
                    if e.get("level") in ("warning", "error") or "segment" in str(e.get("event"))
                ]
                pytest.fail(f"hint {i}: {reply}; an engine lookup now: {hit.chunks} chunks; logged: {logged}")
        again = asyncio.run(ask(nats_server.url, "hint", hint_for(hinted[0], "req-0")))
        # Deduplicated while req-0 is still live; if its copies already finished, nothing is queued.
        assert isinstance(again, p.HintReply) and (
            again.status == "deduped" or (again.status == "accepted" and again.objects_queued == 0)
        )
        bad = msgspec.structs.replace(hint_for(hinted[0], "req-bad"), target_segment="no such/segment")
        with pytest.raises(BadRequest):
            asyncio.run(ask(nats_server.url, "hint", bad))

        async def copied() -> None:
            while not all([await replicas_on(nats_server.url, t, LOCAL) == CHUNKS for t in hinted]):
                await asyncio.sleep(0.05)

        asyncio.run(asyncio.wait_for(copied(), 20.0))
        without = [timed_load(engine, t) for t in unhinted]
        with_hint = [timed_load(engine, t) for t in hinted]
        assert all(n == CHUNKS and same for _, n, same in without + with_hint)
        # Served locally: with the remote segment hung, hinted prefixes still load whole.
        remote.send_signal(signal.SIGSTOP)
        try:
            still = [timed_load(engine, t) for t in hinted[:2]]
        finally:
            remote.send_signal(signal.SIGCONT)
        assert all(n == CHUNKS and same for _, n, same in still)
        status = asyncio.run(ask(nats_server.url, "status", p.PrefetchStatusRequest()))
        assert isinstance(status, p.PrefetchStatus)
        assert status.gauges["leases_held"] == 0 and status.gauges["bytes_in_flight"] == 0
        ms_without = statistics.median(t for t, _, _ in without) * 1000
        ms_with = statistics.median(t for t, _, _ in with_hint) * 1000
        print(f"\nload of 8 x 64 KiB: {ms_without:.2f} ms remote (no hint), {ms_with:.2f} ms local (hinted)")


def test_a_flood_of_hints_is_absorbed_with_busy_answers(nats_server: NatsServer) -> None:
    tokens = prompt(CHUNKS * TOKENS_PER_CHUNK, seed=900)
    with contextlib.ExitStack() as stack:
        stack.enter_context(directory_process(nats_server))
        stack.enter_context(segment_process(nats_server, REMOTE, KVF_SEGMENT_ZONE="zr"))
        with client(nats_server) as writer:
            assert writer.save(tokens, objects_for(tokens, 0, CHUNKS)).chunks_saved == CHUNKS
        stack.enter_context(segment_process(nats_server, LOCAL, KVF_SEGMENT_ZONE="zl"))
        service = stack.enter_context(
            prefetch_process(nats_server, KVF_PREFETCH_HINTS_QUEUED_MAX="64", KVF_PREFETCH_RESOLVING_MAX="8")
        )
        rss_before = rss_bytes(service.pid)

        async def flood() -> dict[str, int]:
            nc = await nats.connect(nats_server.url)
            counts: dict[str, int] = {}
            try:
                for start in range(0, 10_000, 500):
                    replies = await asyncio.gather(
                        *(
                            nc.request(
                                endpoint_subject(Service.PREFETCH, "hint"),
                                msgspec_encode(hint_for(prompt(16, seed=10_000 + i), f"flood-{i}")),
                                timeout=10.0,
                            )
                            for i in range(start, start + 500)
                        ),
                        return_exceptions=True,
                    )
                    for r in replies:
                        if isinstance(r, BaseException):
                            key = type(r).__name__
                        elif r.headers and r.headers.get("Nats-Service-Error-Code"):
                            key = "error:" + r.headers.get("Nats-Service-Error-Code", "")
                        else:
                            decoded = p.prefetch_decoder.decode(r.data)
                            key = decoded.status if isinstance(decoded, p.HintReply) else "other"
                        counts[key] = counts.get(key, 0) + 1
            finally:
                await nc.close()
            return counts

        started = time.monotonic()
        counts = asyncio.run(flood())
        flood_s = time.monotonic() - started
        assert sum(counts.values()) == 10_000, counts
        assert counts.get("busy", 0) + sum(v for k, v in counts.items() if k.startswith("error:")) > 0, counts
        with client(nats_server) as engine:  # normal loads are unaffected
            _, n, same = timed_load(engine, tokens)
            assert n == CHUNKS and same
        status = asyncio.run(ask(nats_server.url, "status", p.PrefetchStatusRequest()))
        assert isinstance(status, p.PrefetchStatus)
        assert status.gauges["hint_ids_live"] <= 64
        grown = rss_bytes(service.pid) - rss_before
        assert grown < 64 << 20, f"the prefetch service grew by {grown >> 20} MiB"
        print(f"\nflood of 10,000 hints in {flood_s:.1f} s: {counts}; RSS grew {grown >> 10} KiB")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def msgspec_encode(message: object) -> bytes:
    from kvfabric.proto.codec import encode

    return encode(message)  # type: ignore[arg-type]


def test_a_hot_prefix_gets_an_extra_replica_that_goes_when_it_cools(nats_server: NatsServer) -> None:
    tokens = prompt(4 * TOKENS_PER_CHUNK, seed=950)
    with contextlib.ExitStack() as stack:
        stack.enter_context(directory_process(nats_server))
        stack.enter_context(segment_process(nats_server, REMOTE, KVF_SEGMENT_ZONE="zr"))
        with client(nats_server) as writer:
            assert writer.save(tokens, objects_for(tokens, 0, 4)).chunks_saved == 4
        stack.enter_context(segment_process(nats_server, LOCAL, KVF_SEGMENT_ZONE="zl"))
        stack.enter_context(
            prefetch_process(
                nats_server,
                KVF_PREFETCH_HOT_READS_PER_S="5",
                KVF_PREFETCH_COLD_READS_PER_S="1",
                KVF_PREFETCH_HOT_WINDOW_MS="2000",
                KVF_PREFETCH_SCAN_MS="200",
            )
        )
        with client(nats_server) as engine:

            async def extra_on_local(want: int, timeout_s: float, reads: bool) -> None:
                async def go() -> None:
                    while await replicas_on(nats_server.url, tokens, LOCAL) != want:
                        if reads:
                            for _ in range(10):
                                await asyncio.to_thread(lambda: engine.release(engine.lookup(tokens)))
                        await asyncio.sleep(0.05)

                await asyncio.wait_for(go(), timeout_s)

            asyncio.run(extra_on_local(4, 20.0, reads=True))  # hot: every chunk gets a second copy
            asyncio.run(extra_on_local(0, 20.0, reads=False))  # cold again: the extra copies go
            _, n, same = timed_load(engine, tokens)  # the original replicas serve on
            assert n == 4 and same
        status = asyncio.run(ask(nats_server.url, "status", p.PrefetchStatusRequest()))
        assert isinstance(status, p.PrefetchStatus)
        assert status.counters["hot_replicas_created_total"] >= 4
        assert status.counters["extra_replicas_removed_total"] >= 4

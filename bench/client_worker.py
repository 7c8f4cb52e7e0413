"""One engine process of `python -m bench.client`: the public client API as an engine calls it.

Each worker owns two `KvClient`s on one `EngineSpec` (16 tokens a chunk, one member): `remote`
(`use_shm=False`: every byte over TCP) and `local` (`use_shm=True`: the co-located segment's arena
read through shared memory). It also holds the transport-level readers of the ceiling rows (one
`TcpDataClient` and one `ShmReader` on the segment), a redis-py client, and three preallocated
numpy buffers: a random `pool` (the source of every object's bytes and the cold memcpy source), a
`save` ring (what an engine hands `save`: a copy of its KV) and a `dest` ring (the engine's KV
blocks that loads write into). The rings hold one whole measurement, so a measurement's calls run
back to back and every load is verified afterwards, before its buffers are reused.

A prompt is `CHUNKS` chunks × one object of the measured size. Every object's bytes are a window
of the pool with a unique 16-byte stamp (size, prompt, chunk, run) at its start, so no two objects
are alike; its expected xxh3-128 checksum is computed from the source before it is saved.

Timed region of each op (all `prompts` calls back to back, `t0` … `t1`):
- `save`: `KvClient.save` per prompt (fresh prompts); `save_async`: every prompt through
  `save_async`, then every future awaited (latency = submit → done). Every SaveResult must
  publish all chunks; the first and last prompt are loaded back afterwards and verified. The
  saved prompts are evicted afterwards (tenants may evict their own groups).
- `lookup_load_release`: lookup + load + release per prompt; `load`: the lookups before `t0`,
  the releases after `t1`; `tcp_get` / `shm_get`: after the same untimed lookups, one
  `get_hashed` of the hit's objects per prompt; `memcpy`: numpy copyto from the cold pool;
  `redis_set` / `redis_get`: one SET / GET per object.
Afterwards (untimed) every destination is compared with its expected checksum: mismatches,
chunks not loaded (short) and their causes are reported with the outcome.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import struct
import time
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from kvfabric.client import EngineSpec, Hit, KvClient, LoadResult, SaveResult, settings_from_env
from kvfabric.client.transfers import read_ref
from kvfabric.dataplane.shm import ShmReader
from kvfabric.dataplane.tcp import TcpDataClient
from kvfabric.format.checksum import checksum
from kvfabric.format.ids import GroupId
from kvfabric.format.key import KVLayout, ModelFingerprint
from kvfabric.proto.directory import EVICT_BATCH_GROUPS_MAX, Evict, EvictReply

TOKENS_PER_CHUNK: Final = 16
CHUNKS: Final = 8  # objects (chunks of one member) per prompt
POOL_BYTES: Final = 256 << 20  # random source: 8 × the 32 MiB L3, so a rotating read is cold
STAMP: Final = struct.Struct("<QQQQ")  # size, prompt, chunk, run: 32 bytes at each object's start
SIZE_MIN_BYTES: Final = STAMP.size
ALIGN_BYTES: Final = 4096
BARRIER_TIMEOUT_S: Final = 120.0
SAVE_WAIT_S: Final = 300.0
EVICT_TIMEOUT_S: Final = 10.0
EVICT_LEASED_RETRIES: Final = 20  # the releases are asynchronous: a just-released lease may linger
EVICT_RETRY_WAIT_S: Final = 0.25
WORKING_SAVES_INFLIGHT: Final = 16  # prompts of the working set saved at once (save_async)
FRESH_PROMPTS_PER_WORKER: Final = 1_000_000  # fresh prompts of worker i are numbered from i × this

# Token kinds: chunk 0 of a prompt carries (kind, size, a, b), so every chain hash is unique.
WORKING: Final = 1
FRESH: Final = 2

OPS: Final = (
    "save",
    "save_async",
    "save_memory",
    "lookup_load_release",
    "load",
    "tcp_get",
    "shm_get",
    "memcpy",
    "redis_set",
    "redis_get",
)
CLIENT_OPS: Final = ("save", "save_async", "lookup_load_release", "load")


Prompt = list[list[memoryview]]  # [chunk][member] buffers of one prompt (one member here)


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    env: dict[str, str]  # the tenant's KVF_CLIENT_* settings
    nats_url: str
    model_id: str  # unique per bench run
    redis_port: int | None
    ring_bytes: int  # one measurement's bytes (the save and dest rings)
    index: int


@dataclasses.dataclass(frozen=True)
class Task:
    """One timed run of one op in one worker."""

    op: str
    client: str  # "remote" | "local" | "" (ops below the client)
    size: int
    prompts: int
    first: int  # first working-set prompt read (rotating); fresh saves use run_id instead
    run_id: int
    engines: int  # engines running this op at once: more than one meet at their barrier before t0


@dataclasses.dataclass
class RunState:
    """What a run's untimed parts share: expected checksums, prompts, and what the calls returned."""

    sums: list[list[bytes]] = dataclasses.field(default_factory=list)
    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    hits: list[Hit] = dataclasses.field(default_factory=list)
    results: list[LoadResult] = dataclasses.field(default_factory=list)
    digests: list[list[tuple[Any, bytes]]] = dataclasses.field(default_factory=list)
    got: list[list[bytes | None]] = dataclasses.field(default_factory=list)
    saved: dict[int, int] = dataclasses.field(default_factory=dict)  # prompt -> chunks its save published


@dataclasses.dataclass
class Outcome:
    t0: float = 0.0
    t1: float = 0.0
    nbytes: int = 0
    lat_s: list[float] = dataclasses.field(default_factory=list)
    verified: int = 0  # objects whose bytes were compared with their expected checksum
    mismatches: int = 0
    short: int = 0  # chunks not loaded (or not saved)
    causes: dict[str, int] = dataclasses.field(default_factory=dict)
    evicted: dict[str, int] = dataclasses.field(default_factory=dict)
    error: str = ""


def prompt_tokens(kind: int, size: int, a: int, b: int) -> list[int]:
    """A prompt of CHUNKS whole chunks; chunk 0 names it, so all its chunk groups are its own."""
    head = [kind, size >> 10, a, b]
    return head + [(7 * i + 1) % 50_000 for i in range(CHUNKS * TOKENS_PER_CHUNK - len(head))]


def object_offset(size: int, serial: int) -> int:
    """Where object `serial` of a size starts in the pool (aligned, rotating over all of it)."""
    slots = (POOL_BYTES - size) // ALIGN_BYTES + 1
    return (serial * 7919 % slots) * ALIGN_BYTES


def bench_spec(client_env: Mapping[str, str], nats_url: str, model_id: str) -> EngineSpec:
    """The engine the benchmarks play: the tenant's share domain, a uint8 "model", one member,
    `TOKENS_PER_CHUNK` tokens a chunk."""
    return EngineSpec(
        settings_from_env(client_env, nats_url=nats_url).share_domain(),
        ModelFingerprint(model_id=model_id, weights_revision="r1", kv_dtype="uint8", attn_config_digest="-"),
        KVLayout(
            tp_size=1,
            tp_rank=0,
            pp_stage=0,
            layer_group=0,
            layer_group_count=1,
            tokens_per_chunk=TOKENS_PER_CHUNK,
            tensor_layout="bench-bytes",
        ),
    )


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        spec = bench_spec(config.env, config.nats_url, config.model_id)
        self.clients = {
            "remote": KvClient(settings_from_env(config.env, nats_url=config.nats_url, use_shm=False), spec),
            "local": KvClient(settings_from_env(config.env, nats_url=config.nats_url, use_shm=True), spec),
        }
        for name, client in self.clients.items():
            if not client.enabled:
                raise RuntimeError(f"the {name} client could not reach the cluster")
        rng = np.random.default_rng(1000 + config.index)
        self.pool = rng.integers(0, 1 << 63, POOL_BYTES // 8, dtype=np.uint64).view(np.uint8)
        self.save_ring = np.zeros(config.ring_bytes, dtype=np.uint8)
        self.dest_ring = np.zeros(config.ring_bytes, dtype=np.uint8)
        self.save_ring.fill(1)  # fault every page in now, not in a timed region
        # The co-located client's save memory (KvClient.save_memory): the engine gathers into it.
        self.save_memory = self.clients["local"].save_memory(config.ring_bytes)
        self.memory_ring = np.frombuffer(self.save_memory.view, np.uint8)
        self.memory_ring.fill(1)
        self.dest_ring.fill(1)
        self.tcp: TcpDataClient | None = None
        self.shm_control: TcpDataClient | None = None
        self.shm: ShmReader | None = None
        self.redis: Any = None
        if config.redis_port is not None:
            import redis

            self.redis = redis.Redis(host="127.0.0.1", port=config.redis_port)
        # size -> expected checksums of the working set's prompts (per prompt, per chunk)
        self.working: dict[int, list[list[bytes]]] = {}

    def close(self) -> None:
        for reader in (self.shm,):
            if reader is not None:
                reader.close()
        for conn in (self.tcp, self.shm_control):
            if conn is not None:
                conn.close()
        if self.redis is not None:
            self.redis.close()
        self.memory_ring = np.zeros(0, np.uint8)  # its view of the save memory goes first
        for client in self.clients.values():
            client.close()

    # ---- data ----------------------------------------------------------------------------------

    def fill(
        self, ring: npt.NDArray[np.uint8], size: int, prompts: int, run_id: int, serial0: int
    ) -> list[list[bytes]]:
        """Unique objects of prompts `serial0 ..` into `ring` (prompt-major); their checksums."""
        sums: list[list[bytes]] = []
        for p in range(prompts):
            row = []
            for c in range(CHUNKS):
                at = (p * CHUNKS + c) * size
                src = object_offset(size, (serial0 + p) * CHUNKS + c)
                dst = ring[at : at + size]
                np.copyto(dst, self.pool[src : src + size])
                dst[: STAMP.size] = np.frombuffer(STAMP.pack(size, serial0 + p, c, run_id), dtype=np.uint8)
                row.append(checksum(dst.data))
            sums.append(row)
        return sums

    def views(self, ring: npt.NDArray[np.uint8], size: int, p: int) -> Prompt:
        base = p * CHUNKS * size
        return [[ring[base + c * size : base + (c + 1) * size].data] for c in range(CHUNKS)]

    def verify(self, size: int, sums: Sequence[Sequence[bytes]], loaded: Sequence[int], out: Outcome) -> None:
        """Compare the destinations of each prompt's `loaded` chunks (what the call says it
        delivered; the rest is counted short) with their expected checksums."""
        for p, (row, count) in enumerate(zip(sums, loaded, strict=True)):
            for c, expected in enumerate(row[:count]):
                at = (p * CHUNKS + c) * size
                out.verified += 1
                if checksum(self.dest_ring[at : at + size].data) != expected:
                    out.mismatches += 1

    # ---- working set -----------------------------------------------------------------------------

    def save_working(self, size: int, prompts: int) -> tuple[list[list[bytes]], dict[str, int]]:
        """Save the working set of a size (and put the same objects into Redis): its checksums."""
        client = self.clients["remote"]
        sums: list[list[bytes]] = []
        failures: Counter[str] = Counter()
        per_batch = max(1, min(WORKING_SAVES_INFLIGHT, self.config.ring_bytes // (CHUNKS * size)))
        for first in range(0, prompts, per_batch):
            batch = min(per_batch, prompts - first)
            batch_sums = self.fill(self.save_ring, size, batch, 0, first)
            futures = []
            for p in range(batch):
                objs = self.views(self.save_ring, size, p)
                future = client.save_async(prompt_tokens(WORKING, size, 0, first + p), objs)
                if future is None:
                    failures["dropped"] += CHUNKS
                else:
                    futures.append(future)
                if self.redis is not None:
                    pipe = self.redis.pipeline(transaction=False)
                    for c in range(CHUNKS):
                        pipe.set(f"ws:{size}:{first + p}:{c}", objs[c][0])
                    pipe.execute()
            for future in futures:
                result = future.result(SAVE_WAIT_S)
                failures.update(result.causes)
                if result.chunks_saved + result.chunks_existing != CHUNKS:
                    failures["short"] += CHUNKS - result.chunks_saved - result.chunks_existing
            sums += batch_sums
        return sums, dict(failures)

    def evict(self, tokens: Sequence[Sequence[int]]) -> dict[str, int]:
        """Evict the chunk groups of these prompts (a tenant may evict its own): status counts.
        Groups still leased (a release not yet applied) are asked again, a bounded number of times."""
        client = self.clients["remote"]
        raws = [g.group_id() for t in tokens for g in client.aio.chunk_groups(t)]
        statuses: Counter[str] = Counter()
        for attempt in range(EVICT_LEASED_RETRIES + 1):
            leased = asyncio.run_coroutine_threadsafe(
                self._evict(client, raws, statuses), client._loop
            ).result(EVICT_TIMEOUT_S * (1 + len(raws) // EVICT_BATCH_GROUPS_MAX) * 2)
            if not leased or attempt == EVICT_LEASED_RETRIES:
                if leased:
                    statuses["leased"] += len(leased)
                break
            raws = leased
            time.sleep(EVICT_RETRY_WAIT_S)
        return dict(statuses)

    async def _evict(self, client: KvClient, raws: list[GroupId], statuses: Counter[str]) -> list[GroupId]:
        router = client.aio.router
        if router is None:
            raise RuntimeError("client not started")
        await router.known_shards()
        by_shard: dict[int, list[GroupId]] = {}
        for raw in raws:
            by_shard.setdefault(router.shard_of(raw), []).append(raw)
        leased: list[GroupId] = []
        for shard, groups in by_shard.items():
            for i in range(0, len(groups), EVICT_BATCH_GROUPS_MAX):
                batch = groups[i : i + EVICT_BATCH_GROUPS_MAX]
                reply = await router.ask(shard, "evict", Evict(groups=batch, reason="bench"), EVICT_TIMEOUT_S)
                if not isinstance(reply, EvictReply):
                    raise RuntimeError(f"evict answered {type(reply).__name__}")
                for result in reply.results:
                    if result.status == "leased":
                        leased.append(result.group)
                    else:
                        statuses[result.status] += 1
        return leased

    # ---- runs ----------------------------------------------------------------------------------

    def run(self, task: Task, barriers: dict[int, Any]) -> Outcome:
        out = Outcome()
        state = RunState()
        timed: Callable[[], None] | None = None
        try:
            timed = self.prepare(task, out, state)
        except Exception:
            out.error = traceback.format_exc(limit=4)[-800:]
        if task.engines > 1:  # also after a failed preparation: the others wait here
            barriers[task.engines].wait(BARRIER_TIMEOUT_S)
        if timed is None:
            return out
        try:
            timed()
            self.after(task, out, state)
        except Exception:
            out.error = traceback.format_exc(limit=4)[-800:]
        return out

    def prepare(self, task: Task, out: Outcome, state: RunState) -> Callable[[], None]:
        """Everything before t0; returns the timed part (which sets out.t0, out.t1, out.lat_s)."""
        size, n = task.size, task.prompts
        if n * CHUNKS * size > self.config.ring_bytes:
            raise ValueError(f"{n} prompts of {size} B objects exceed the {self.config.ring_bytes} B rings")
        if task.op not in OPS:
            raise ValueError(f"unknown op {task.op!r}")
        out.nbytes = n * CHUNKS * size
        if task.op in ("save", "save_async", "save_memory", "redis_set"):
            serial0 = self.config.index * FRESH_PROMPTS_PER_WORKER
            ring = self.memory_ring if task.op == "save_memory" else self.save_ring
            state.sums = self.fill(ring, size, n, task.run_id, serial0)
            state.tokens = [prompt_tokens(FRESH, size, task.run_id, serial0 + p) for p in range(n)]
            sources = [self.views(ring, size, p) for p in range(n)]
            if task.op == "redis_set":
                return self._redis_set(out, sources)
            client = self.clients[task.client]
            if task.op in ("save", "save_memory"):
                return self._save(out, state, client, state.tokens, sources)
            return self._save_async(out, state, client, state.tokens, sources)

        # Reads of the working set, from prompt `first` on (rotating over it).
        working = self.working[size]
        order = [(task.first + p) % len(working) for p in range(n)]
        state.sums = [working[i] for i in order]
        state.tokens = [prompt_tokens(WORKING, size, 0, i) for i in order]
        self.dest_ring[: out.nbytes].fill(0)  # nothing from an earlier run can pass verification
        dests = [self.views(self.dest_ring, size, p) for p in range(n)]
        if task.op == "memcpy":
            state.sums = []  # the machine's limit: nothing to verify
            return self._memcpy(out, size, n, task.run_id)
        if task.op == "redis_get":
            return self._redis_get(out, state, [[f"ws:{size}:{i}:{c}" for c in range(CHUNKS)] for i in order])
        client = self.clients[self.client_of(task)]
        if task.op == "lookup_load_release":
            return self._lookup_load_release(out, state, client, dests)
        # load, tcp_get, shm_get: the lookups (and the releases) outside the timed region.
        state.hits = [client.lookup(t) for t in state.tokens]
        if task.op == "load":
            return self._load(out, state, client, dests)
        return self._transport_get(out, state, self._reader(task.op, state.hits), dests)

    @staticmethod
    def client_of(task: Task) -> str:
        """The client a task uses: its own, or the one whose lookups a transport get reads."""
        if task.op == "shm_get":
            return "local"
        return task.client or "remote"

    def _save(
        self, out: Outcome, state: RunState, client: KvClient, tokens: list[list[int]], sources: list[Prompt]
    ) -> Callable[[], None]:
        saved = state.saved

        def save() -> None:
            out.t0 = now()
            for p, objs in enumerate(sources):
                t = now()
                result = client.save(tokens[p], objs)
                out.lat_s.append(now() - t)
                count_save(result, out)
                saved[p] = result.chunks_saved
            out.t1 = now()

        return save

    def _save_async(
        self, out: Outcome, state: RunState, client: KvClient, tokens: list[list[int]], sources: list[Prompt]
    ) -> Callable[[], None]:
        n = len(sources)
        saved = state.saved
        started = [0.0] * n
        done_at = [0.0] * n

        def finished(p: int) -> Callable[[object], None]:
            def callback(_: object) -> None:
                done_at[p] = now()  # on the client's loop thread; one writer per slot

            return callback

        def save_async() -> None:
            futures: dict[int, concurrent.futures.Future[SaveResult]] = {}
            out.t0 = now()
            for p, objs in enumerate(sources):
                started[p] = now()
                future = client.save_async(tokens[p], objs)
                if future is None:
                    add(out.causes, "dropped", CHUNKS)
                    out.short += CHUNKS
                    continue
                future.add_done_callback(finished(p))
                futures[p] = future
            _, pending = concurrent.futures.wait(futures.values(), SAVE_WAIT_S)
            out.t1 = now()
            if pending:
                raise TimeoutError(f"{len(pending)} saves still running after {SAVE_WAIT_S:.0f} s")
            for p, future in futures.items():
                result = future.result(0)
                count_save(result, out)
                saved[p] = result.chunks_saved
            out.lat_s += [d - s for d, s in zip(done_at, started, strict=True) if d]

        return save_async

    def _redis_set(self, out: Outcome, sources: list[Prompt]) -> Callable[[], None]:
        redis, worker = self.redis, self.config.index
        if redis is None:
            raise RuntimeError("no redis-server")
        keys = [[f"set:{worker}:{p}:{c}" for c in range(CHUNKS)] for p in range(len(sources))]

        def redis_set() -> None:
            out.t0 = now()
            for row, objs in zip(keys, sources, strict=True):
                t = now()
                for key, obj in zip(row, objs, strict=True):
                    redis.set(key, obj[0])
                out.lat_s.append(now() - t)
            out.t1 = now()

        return redis_set

    def _redis_get(self, out: Outcome, state: RunState, keys: list[list[str]]) -> Callable[[], None]:
        redis = self.redis
        if redis is None:
            raise RuntimeError("no redis-server")
        got = state.got

        def redis_get() -> None:
            out.t0 = now()
            for row in keys:
                t = now()
                got.append([redis.get(k) for k in row])
                out.lat_s.append(now() - t)
            out.t1 = now()

        return redis_get

    def _memcpy(self, out: Outcome, size: int, n: int, run_id: int) -> Callable[[], None]:
        ring, pool = self.dest_ring, self.pool
        spans = [
            ((p * CHUNKS + c) * size, object_offset(size, (run_id * n + p) * CHUNKS + c))
            for p in range(n)
            for c in range(CHUNKS)
        ]

        def memcpy() -> None:
            out.t0 = now()
            for p in range(n):
                t = now()
                for at, src in spans[p * CHUNKS : (p + 1) * CHUNKS]:
                    np.copyto(ring[at : at + size], pool[src : src + size])
                out.lat_s.append(now() - t)
            out.t1 = now()

        return memcpy

    def _lookup_load_release(
        self, out: Outcome, state: RunState, client: KvClient, dests: list[Prompt]
    ) -> Callable[[], None]:
        tokens, hits, results = state.tokens, state.hits, state.results

        def lookup_load_release() -> None:
            out.t0 = now()
            for p, dest in enumerate(dests):
                t = now()
                hit = client.lookup(tokens[p])
                result = client.load(hit, dest[: hit.chunks])  # a short hit: its chunks only
                client.release(hit)
                out.lat_s.append(now() - t)
                hits.append(hit)
                results.append(result)
            out.t1 = now()

        return lookup_load_release

    def _load(
        self, out: Outcome, state: RunState, client: KvClient, dests: list[Prompt]
    ) -> Callable[[], None]:
        hits, results = state.hits, state.results

        def load() -> None:
            out.t0 = now()
            for hit, dest in zip(hits, dests, strict=True):
                t = now()
                results.append(client.load(hit, dest[: hit.chunks]))
                out.lat_s.append(now() - t)
            out.t1 = now()

        return load

    def _transport_get(
        self, out: Outcome, state: RunState, reader: TcpDataClient | ShmReader, dests: list[Prompt]
    ) -> Callable[[], None]:
        refs = [
            [read_ref(loc[0].replicas[0], loc[0].size_bytes) for loc in hit.objects] for hit in state.hits
        ]
        flat = [[d[0] for d in dest[: len(r)]] for dest, r in zip(dests, refs, strict=True)]
        digests = state.digests

        def transport_get() -> None:
            out.t0 = now()
            for r, d in zip(refs, flat, strict=True):
                t = now()
                digests.append(reader.get_hashed(r, d) if r else [])
                out.lat_s.append(now() - t)
            out.t1 = now()

        return transport_get

    def _reader(self, op: str, hits: Sequence[Hit]) -> TcpDataClient | ShmReader:
        """The transport reader of a ceiling row, on the segment the hits name (opened once)."""
        first = next((h.objects[0][0] for h in hits if h.chunks), None)
        if first is None:
            raise RuntimeError("no hit to read: the working set is missing")
        addr = first.replicas[0].data_addr
        if op == "tcp_get":
            if self.tcp is None:
                self.tcp = TcpDataClient.connect(addr)
            return self.tcp
        if self.shm is None:
            self.shm_control = TcpDataClient.connect(addr)
            # The segment hands its arena path only to token holders: one of the hits' tokens.
            self.shm = ShmReader(self.shm_control, reads=[read_ref(first.replicas[0], first.size_bytes)])
        return self.shm

    def after(self, task: Task, out: Outcome, state: RunState) -> None:
        """Untimed: check and verify what the run did, release its leases, evict its saves."""
        op, size = task.op, task.size
        if op in ("save", "save_async", "save_memory"):
            self._read_back(task, out, state)
            out.evicted = self.evict(state.tokens)
            return
        if op in ("memcpy", "redis_set"):
            return
        if op == "redis_get":
            for row, sums in zip(state.got, state.sums, strict=True):
                for value, expected in zip(row, sums, strict=True):
                    out.verified += 1
                    if value is None or len(value) != size:
                        out.short += 1
                    elif checksum(value) != expected:
                        out.mismatches += 1
            return
        for hit in state.hits:
            if hit.chunks < CHUNKS:
                add(out.causes, f"lookup:{hit.cause or 'miss'}", 1)
        if op in ("lookup_load_release", "load"):
            for result in state.results:
                if result.chunks_loaded < CHUNKS:
                    out.short += CHUNKS - result.chunks_loaded
                    add(out.causes, result.cause or "miss", CHUNKS - result.chunks_loaded)
            loaded = [r.chunks_loaded for r in state.results]
        else:  # transport gets: the objects read ok, in order (the destinations say if they match)
            loaded = []
            for got in state.digests:
                ok = next((i for i, (result, _) in enumerate(got) if result.status != "ok"), len(got))
                loaded.append(ok)
                out.short += CHUNKS - ok
                for result, _ in got[ok:]:
                    add(out.causes, result.status, 1)
                if len(got) < CHUNKS:  # a short hit
                    add(out.causes, "miss", CHUNKS - len(got))
        if op != "lookup_load_release":
            client = self.clients[self.client_of(task)]
            for hit in state.hits:
                client.release(hit)
        self.verify(size, state.sums, loaded, out)

    def _read_back(self, task: Task, out: Outcome, state: RunState) -> None:
        """Load the first and the last prompt back (if their saves published every chunk: the
        others are counted short already) and compare their bytes."""
        client = self.clients[task.client]
        size = task.size
        for p in sorted({0, task.prompts - 1}):
            if state.saved.get(p) != CHUNKS:
                continue
            self.dest_ring[: CHUNKS * size].fill(0)
            hit = client.lookup(state.tokens[p])
            result = client.load(hit, self.views(self.dest_ring, size, 0)[: hit.chunks])
            client.release(hit)
            if result.chunks_loaded < CHUNKS:
                out.short += CHUNKS - result.chunks_loaded
                add(
                    out.causes,
                    f"read back:{result.cause or hit.cause or 'miss'}",
                    CHUNKS - result.chunks_loaded,
                )
            self.verify(size, [state.sums[p]], [result.chunks_loaded], out)


def now() -> float:
    return time.perf_counter()  # CLOCK_MONOTONIC: comparable between the worker processes


def add(counts: dict[str, int], key: str, n: int) -> None:
    counts[key] = counts.get(key, 0) + n


def count_save(result: SaveResult, out: Outcome) -> None:
    """A save must publish every chunk of its fresh prompt."""
    if result.chunks_saved != CHUNKS:
        out.short += CHUNKS - result.chunks_saved
    for cause, count in result.causes.items():
        add(out.causes, cause, count)


def worker_main(conn: Connection, barriers: dict[int, Any], config: WorkerConfig) -> None:
    """Serve the bench: ("working", size, prompts) | ("set_working", size, sums) |
    ("evict_working", size) | ("run", Task) | None (stop)."""
    try:
        worker = Worker(config)
    except Exception:
        conn.send(("error", traceback.format_exc(limit=6)))
        return
    conn.send(("ready", config.index))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            reply: Any
            try:
                if msg[0] == "run":
                    reply = worker.run(msg[1], barriers)
                elif msg[0] == "working":
                    reply = ("ok", *worker.save_working(msg[1], msg[2]))
                elif msg[0] == "set_working":
                    worker.working = {msg[1]: msg[2]}
                    reply = ("ok",)
                elif msg[0] == "evict_working":
                    size = msg[1]
                    count = len(worker.working.get(size, ())) or msg[2]
                    reply = ("ok", worker.evict([prompt_tokens(WORKING, size, 0, i) for i in range(count)]))
                else:
                    reply = ("error", f"unknown message {msg[0]!r}")
            except Exception:
                reply = ("error", traceback.format_exc(limit=6))
            conn.send(reply)
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        worker.close()

"""The asyncio client: lookup (folded hit + read lease), verified loads, two-phase saves.

Rules every method keeps (issue 5, docs/design.md 3):
- **Failures never raise into the engine.** A miss, timeout, partial load, checksum mismatch,
  stale generation, dead segment or unreachable directory shortens the hit or the load to the
  last verified chunk and is counted by cause (`metrics.fallbacks`). Only caller bugs (bad token
  ids, wrongly sized buffers) raise.
- **Ownership.** Transports write straight into the engine's buffers, block by block under the
  load's `WriteGate` (`kvfabric.dataplane.scatter`), which `load` closes before it returns:
  then no transfer writes into them any more, whatever thread it runs on. A chunk is reported
  loaded only once the hash of what landed matched the directory's checksum.
- **Coalescing.** Concurrent loads of one object share one transfer (`LoadTable`): it writes
  into the buffers of the load that started it; a joiner copies from there on the loop thread
  (the `LoadTable` fence: `may_write` -> copy -> `delivered`), only while those are still lent.
- **Bounded.** Transfers and their bytes are bounded by the table (Busy -> shorter load); worker
  threads by `transfers_max`; save bytes and queued saves by `save_inflight_bytes_max` and
  `saves_queued_max` (over -> the save is dropped and counted, never queued without bound).
- **Leases** are released by `release`, and expire at the directory if the client dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, TypeVar

from nats.aio.client import Client as NatsClient

from kvfabric.client.busy import retry_busy
from kvfabric.client.connect import open_nats
from kvfabric.client.hits import Hit, LoadResult, SaveResult
from kvfabric.client.metrics import ClientMetrics
from kvfabric.client.releases import RELEASES_CONCURRENT_MAX, give_back
from kvfabric.client.saves import (
    SavePlan,
    SaveTally,
    confirm_counts,
    object_specs,
    plan_save,
    with_receipts,
    write_streams,
)
from kvfabric.client.settings import ClientSettings
from kvfabric.client.shared_calls import SharedCalls
from kvfabric.client.suspects import REPORT_TIMEOUT_S, SuspectReporter
from kvfabric.client.threads import thread_placement
from kvfabric.client.transfers import SegmentPool
from kvfabric.cluster.lookups import RELEASE_MANY_VERB, lookup_prefix
from kvfabric.core.client_loads import (
    Busy,
    CancelTransfer,
    Deliver,
    DestId,
    Effect,
    Fail,
    LoadTable,
    ReleaseStaging,
    StartTransfer,
    TransferId,
)
from kvfabric.dataplane.scatter import GateClosed, ScatterDest, WriteGate, scatter_dests
from kvfabric.dataplane.tls import client_context
from kvfabric.format.checksum import checksum
from kvfabric.format.clock import monotonic_ms as _now_ms
from kvfabric.format.errors import (
    BadRequest,
    Indeterminate,
    KvfError,
    RateLimited,
    StaleGeneration,
    Unavailable,
)
from kvfabric.format.generations import RequestGeneration
from kvfabric.format.key import (
    ChunkExtras,
    ChunkGroupId,
    KVLayout,
    MemberId,
    ModelFingerprint,
    ShareDomain,
    TokenIds,
    chunk_groups_for_prefix,
)
from kvfabric.proto import directory as m
from kvfabric.proto.common import TRACE_ID_HEADER
from kvfabric.runtime.directory_router import DirectoryRouter

__all__ = ["AsyncKvClient", "Destination", "EngineSpec", "Source"]

# Objects per data-plane request when a load reads several from one segment: small objects share
# a request (fewer round trips); large ones go one or two a request, so several requests run at
# once on separate connections and worker threads (the segment sends while this side receives
# and hashes). A request carries at most `FETCH_BATCH_BYTES_TARGET` bytes unless one object is
# larger. (Co-located reads split the same way: measured, batching them on one thread was no
# better, 3.75 vs 4.35 GB/s at 1 MiB and 5.75 vs 5.23 at 4 MiB, within this VM's noise.)
FETCH_BATCH_OBJECTS_MAX: Final = 8
FETCH_BATCH_BYTES_TARGET: Final = 2 << 20
# A co-located request of at most this many bytes is read on the loop thread (`SegmentPool.
# fetch_local_now`: an arena copy with the hash fused, no round trip) instead of a worker thread:
# the hop there and back cost about 0.5 ms p50 here, a 2 MiB copy about 0.3 ms (2026-12-02). The
# loop is held that long; larger requests still go to the worker threads and overlap.
LOCAL_INLINE_BYTES_MAX: Final = 2 << 20
# Save-path directory requests (put_begin, put_commit, put_abort) of one client in flight at once,
# all saves together: half a tenant's default share of the directory's in-flight slots (16), so
# two engines of one tenant pipelining saves fit; past the share, `busy` is retried with a
# backoff (`kvfabric.client.busy`) at most SAVE_BUSY_ATTEMPTS_MAX times within the save's timeout.
SAVE_DIRECTORY_CALLS_MAX: Final = 8
SAVE_BUSY_ATTEMPTS_MAX: Final = 8
# A save of at most this many bytes is hashed on the loop thread (xxh3-128: ~0.03 ms for 2 MiB
# here), not on a save thread: the hop there and back cost 0.05 ms p50, 0.55 ms p90 on this
# loaded 2-core VM (2026-12-01), more than the hash. Larger saves hash off the loop.
SAVE_INLINE_CHECKSUM_BYTES_MAX: Final = 4 << 20
# A save's writes to one segment are pipelined on one connection in streams of about this many
# bytes (`saves.write_streams`): 8 × 256 KiB took 1.3 ms p50 sent / 1.0 ms staged as one stream vs
# 2.0 / 1.5 ms as 8 threads with a connection each (8 × 1 MiB: 4.4 / 2.6 vs 4.4 / 3.0 ms), to one
# segment process below the directory on this loaded 2-core VM (2026-12-02); larger objects keep
# parallel streams.
SAVE_WRITE_STREAM_BYTES_TARGET: Final = 2 << 20
# Releases an engine does not wait for (`release_soon`, what `KvClient.release` does) are gathered
# for up to `RELEASE_GATHER_MS` and given back together, at once when `RELEASE_GATHER_LEASES_MAX`
# are waiting (one full `lease_release` batch): a prompt's release is then no directory request of
# its own competing with the engine's next lookup (NATS, the directory and this loop share 2 cores
# here). A gathered lease is still held (`_leases`): `close` gives it back with the rest; a lease
# held this much longer only delays the eviction of what it covers.
RELEASE_GATHER_MS: Final = 20
RELEASE_GATHER_LEASES_MAX: Final = m.RELEASE_BATCH_LEASES_MAX

Destination: TypeAlias = memoryview | bytearray | Sequence[memoryview]
"""Where one object's bytes go: one writable buffer, or a scatter list of writable byte views
whose sizes add up to the object's size (e.g. one block of every layer's paged KV tensor)."""

Source: TypeAlias = bytes | bytearray | memoryview
"""One object's bytes to save; owned by the client from the call on (the caller must not
change it until the save finishes: pass a copy of engine memory)."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Who the engine is: the share domain, model and KV layout that name its keys, and the
    members (tp rank, pp stage, layer group) a hit must contain to be usable."""

    domain: ShareDomain
    model: ModelFingerprint
    layout: KVLayout
    members: tuple[MemberId, ...] = ()

    def required_members(self) -> tuple[MemberId, ...]:
        return self.members or (self.layout.member,)


T = TypeVar("T")


def directory_cause(exc: KvfError | TimeoutError, other: str = "") -> str:
    """The cause a failed directory call is counted under (lookup fallbacks, save failures): a
    replaced leader's reply `directory_stale_epoch`, no leader or no directory
    `directory_unavailable`, no answer in time `directory_timeout`, the tenant's request rate
    `rate_limited` (a miss now, recompute); any other error `other` where given (a lookup:
    `directory_error`), else its wire code (a save: `busy` past its retries, `no_capacity`...)."""
    if isinstance(exc, StaleGeneration):
        return "directory_stale_epoch"
    if isinstance(exc, Unavailable):
        return "directory_unavailable"
    if isinstance(exc, Indeterminate | TimeoutError):
        return "directory_timeout"
    if isinstance(exc, RateLimited):
        return RateLimited.code
    return other or exc.code


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[str]
    dest: ScatterDest  # the engine's buffers for this object, under the load's gate
    deadline_ms: int  # the load's (client monotonic clock, `_now_ms`)


@dataclass(slots=True)
class _Target:
    """Where a transfer writes: straight into the buffers of the waiter that started it."""

    load_id: Any
    dest: ScatterDest


def _shard_batches(
    items: Sequence[T], shard_of: Callable[[T], int], batch_max: int = m.PUT_BATCH_OBJECTS_MAX
) -> Iterator[tuple[int, int, list[T]]]:
    """(shard, offset, batch): the items split by shard (first-seen order, each shard's in the
    original order), in batches of at most `batch_max` (a request takes one shard)."""
    by_shard: dict[int, list[T]] = {}
    for item in items:
        by_shard.setdefault(shard_of(item), []).append(item)
    for shard, mine in by_shard.items():
        for start in range(0, len(mine), batch_max):
            yield shard, start, mine[start : start + batch_max]


def _spec_key(spec: m.ObjectSpec) -> bytes:
    return spec.key


def _same_key(key: bytes) -> bytes:
    return key


def _commit_key(item: tuple[bytes, list[m.WriteReceipt]]) -> bytes:
    return item[0]


class AsyncKvClient:
    """One engine's client. Create, `await start()`, use, `await close()`; one event loop."""

    def __init__(
        self, settings: ClientSettings, spec: EngineSpec, *, metrics: ClientMetrics | None = None
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.metrics = metrics or ClientMetrics()
        self.nc: NatsClient | None = None
        self.table = LoadTable(
            transfers_max=settings.transfers_max, inflight_bytes_max=settings.load_inflight_bytes_max
        )
        self.pool = SegmentPool(
            connections_per_segment_max=settings.connections_per_segment_max,
            timeout_s=settings.load_timeout_ms / 1000,
            use_shm=settings.use_shm,
            lockfree_local_reads=settings.local_reads_lockfree,
            verify=not settings.unsafe_skip_verification_for_tests,
            local_segments=frozenset(s for s in settings.local_segments.split(",") if s),
            on_retry=self.metrics.replica_retries.inc,
            tls=client_context(settings.data_tls_ca) if settings.data_tls_ca else None,
            attempt_share=settings.replica_attempt_share_pct / 100,
            attempt_min_s=settings.replica_attempt_min_ms / 1000,
        )
        self._executor = ThreadPoolExecutor(  # thread_cpus decided here, in the creating thread
            settings.transfers_max,
            thread_name_prefix="kvf-transfer",
            initializer=thread_placement(settings.thread_cpus, background=False),
        )
        self._save_executor = ThreadPoolExecutor(
            max(1, settings.transfers_max // 2),
            thread_name_prefix="kvf-save",
            initializer=thread_placement(settings.thread_cpus, background=True),
        )
        self._waiters: dict[Any, _Waiter] = {}
        self._targets: dict[TransferId, _Target] = {}  # StartTransfer .. ReleaseStaging
        self._locations: dict[Any, m.ObjectLocation] = {}  # object id -> where (for StartTransfer)
        self._load_seq = itertools.count(1)
        self._generations = itertools.count(1)
        self._leases: dict[tuple[int, int], int] = {}  # (shard, lease id) -> expires_ms (directory clock)
        self.router: DirectoryRouter | None = None  # the shard map; epochs per shard (fencing)
        # directory instances without `lookup_many` / `lease_release_many` (older): shard by shard
        self._lookup_many_refused: set[str] = set()
        self._save_bytes = 0
        self._saves_running = 0
        # Writes this client runs at once per segment: what a segment may gather for one confirm.
        self._writes_at_once = min(max(1, settings.transfers_max // 2), settings.connections_per_segment_max)
        # The save-path directory requests, shared by the saves in flight (`SharedCalls`).
        holder = settings.holder_id
        self._begins = self._save_calls(
            "put_begin",
            lambda rid, specs: m.PutBegin(
                writer_id=holder, request_id=rid, objects=specs, write_ttl_ms=settings.write_ttl_ms
            ),
            # a put_begin's reply holds a ticket per replica: batches whose reply always fits NATS's
            # max_payload (the directory refuses a larger one with batch_too_large, placing nothing)
            m.PUT_BEGIN_BATCH_OBJECTS_FIT,
        )
        self._commits = self._save_calls(
            "put_commit",
            lambda rid, items: m.PutCommit(
                writer_id=holder,
                request_id=rid,
                keys=[key for key, _ in items],
                receipts=[r for _, receipts in items for r in receipts],
            ),
            # keys with their receipts (up to replicas_max each): the request stays far below
            # NATS's max_payload and the receipts below PUT_BATCH_OBJECTS_MAX
            m.PUT_BEGIN_BATCH_OBJECTS_FIT,
        )
        self._aborts = self._save_calls(
            "put_abort",
            lambda rid, keys: m.PutAbort(writer_id=holder, request_id=rid, keys=keys),
            m.PUT_BATCH_OBJECTS_MAX,
        )
        self._tasks: set[asyncio.Task[Any]] = set()  # running saves
        self._capacity = asyncio.Event()  # set whenever a transfer ends (ReleaseStaging: room again)
        # not dispatched yet: (transfer, where, the starter's buffers, the starter's deadline ms)
        self._starting: list[tuple[TransferId, m.ObjectLocation, ScatterDest, int]] = []
        self._closed = False
        self.suspects: SuspectReporter | None = None  # reports of corrupt replicas (after start)
        # `release_soon`: leases gathered for the next give-back (still in `_leases`), its timer,
        # and the give-backs in flight (`close` waits for them)
        self._gathered: list[tuple[int, int]] = []
        self._gathered_trace = ""  # the trace id the gathered give-back is sent with
        self._gather_timer: asyncio.TimerHandle | None = None
        self._giving_back: set[asyncio.Task[None]] = set()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to NATS and check access, within `connect_timeout_ms` (`kvfabric.client.connect`):
        `BadRequest` for a setting the client cannot use, `Unauthorized` when NATS refuses it,
        `Unavailable` when no server listens, `Indeterminate` when none answers in time."""
        self.nc, self.router = await open_nats(self.settings)
        self.suspects = SuspectReporter(
            asyncio.get_running_loop(), lambda: self.router, self.metrics.corrupt_reports
        )
        self.pool.on_corrupt = self.suspects.seen  # a bad replica is reported, never dropped here
        if self.settings.metrics_port >= 0:
            self.metrics.serve(self.settings.metrics_port)

    async def close(self) -> None:
        """Release every lease still held, wait for running saves, close connections."""
        if self._closed:
            return
        self._closed = True
        if self._gather_timer is not None:
            self._gather_timer.cancel()
            self._gather_timer = None
        gathered, self._gathered = self._gathered, []
        await self._release_leases(gathered, self._gathered_trace)  # with their hit's trace id
        await self._release_leases(list(self._leases))  # every other one held
        if self._giving_back:  # gathered give-backs already sent: wait for their answers
            await asyncio.wait(list(self._giving_back), timeout=self.settings.lookup_timeout_ms / 1000)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.settings.save_timeout_ms / 1000)
        if self.suspects is not None:
            await self.suspects.close(REPORT_TIMEOUT_S)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.drain()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._save_executor.shutdown(wait=True, cancel_futures=True)
        self.pool.close()

    # ---- lookup ----------------------------------------------------------------------------

    def chunk_groups(self, tokens: TokenIds, extras: ChunkExtras | None = None) -> list[ChunkGroupId]:
        spec = self.spec
        return chunk_groups_for_prefix(spec.domain, spec.model, spec.layout, tokens, extras)

    async def lookup(
        self,
        tokens: TokenIds,
        *,
        max_tokens: int | None = None,
        extras: ChunkExtras | None = None,
        trace_id: str | None = None,
    ) -> Hit:
        """The folded hit for `tokens` (at most `max_tokens`), read-leased. Never raises for a
        cluster failure: the hit is empty with `cause` set."""
        groups = self.chunk_groups(tokens, extras)
        tpc = self.spec.layout.tokens_per_chunk
        if max_tokens is not None:
            groups = groups[: max(0, max_tokens) // tpc]
        groups = groups[: m.LOOKUP_BATCH_GROUPS_MAX]
        members = self.spec.required_members()
        trace_id = trace_id or uuid.uuid4().hex
        empty = Hit(0, tpc, tuple(groups), members, trace_id=trace_id)
        self.metrics.lookups.inc()
        if not groups:
            return empty
        if self.nc is None or self._closed:
            return self._fallback(empty, "closed")
        started = time.perf_counter()
        try:
            hit_chunks, objects, leases, expires = await self._lookup_shards(groups, members, trace_id)
        except KvfError as exc:
            return self._fallback(empty, directory_cause(exc, other="directory_error"))
        finally:
            self.metrics.lookup_seconds.observe(time.perf_counter() - started)
        by_position = {
            (o.chunk_index, MemberId(o.member.tp_rank, o.member.pp_stage, o.member.layer_group)): (
                self.pool.prefer_local(o)
            )
            for o in objects
        }
        rows: list[tuple[m.ObjectLocation, ...]] = []
        for chunk in range(min(hit_chunks, len(groups))):
            row = tuple(by_position.get((chunk, member)) for member in members)
            if any(o is None for o in row):
                break  # a directory that folded wrongly: trust only the complete prefix
            rows.append(row)  # type: ignore[arg-type]
        for lease in leases:
            self._leases[lease] = expires
        self.metrics.leases_held.set(len(self._leases))
        hit = Hit(
            len(rows) * tpc,
            tpc,
            tuple(groups),
            members,
            tuple(rows),
            leases[0][1] if leases else 0,
            expires,
            trace_id=trace_id,
            shard_leases=tuple(leases),
        )
        self.metrics.hit_tokens.inc(hit.tokens)
        return hit

    async def _lookup_shards(
        self, groups: list[ChunkGroupId], members: tuple[MemberId, ...], trace_id: str
    ) -> tuple[int, list[m.ObjectLocation], list[tuple[int, int]], int]:
        """The lookups of every shard holding some of the prefix's chunks, merged by
        `kvfabric.cluster.lookups.lookup_prefix` (one request per leading instance): the hit is
        the first chunk any shard misses (a shard that fails misses from its first chunk); every
        shard with a chunk inside the hit keeps its lease (released with the hit), the others'
        are given back at once. Raises the first failure only when nothing hit."""

        async def give_back(leases: list[tuple[int, int]]) -> None:
            for lease in leases:  # held until given back (`_release_leases` gives back held ones)
                self._leases[lease] = 0
            await self._release_leases(leases, trace_id)

        hit = await lookup_prefix(
            self._router(),
            [g.to_bytes() for g in groups],
            holder_id=self.settings.holder_id,
            members=[m.Member(*member) for member in members],
            lease_ttl_ms=self.settings.lease_ttl_ms,
            timeout_s=self.settings.lookup_timeout_ms / 1000,
            trace_id=trace_id,
            refused=self._lookup_many_refused,
            give_back=give_back,
        )
        if hit.failure is not None:
            self.metrics.fallbacks.labels("directory_shard_partial").inc()
        return hit.hit_chunks, hit.objects, hit.leases, hit.expires_ms

    def _fallback(self, hit: Hit, cause: str) -> Hit:
        self.metrics.fallbacks.labels(cause).inc()
        return Hit(0, hit.tokens_per_chunk, hit.groups, hit.members, cause=cause)

    async def release(self, hit: Hit) -> None:
        """Give the hit's read leases back now and wait for the answer (idempotent; a lost release
        expires at the directory). An engine that does not wait uses `release_soon`."""
        await self._release_leases(hit.shard_leases, hit.trace_id)

    def release_soon(self, hit: Hit) -> None:
        """Give the hit's read leases back without waiting (loop thread; idempotent): gathered with
        other hits' for up to `RELEASE_GATHER_MS`, sent at once when `RELEASE_GATHER_LEASES_MAX`
        wait, sent by `close` if it comes first. Never lost: until sent, a lease stays held, and
        `close` gives back every lease held."""
        if self._closed:
            return  # close gave back every lease held
        if not self._gathered:
            self._gathered_trace = hit.trace_id  # the batch's requests carry its first hit's
        waiting = set(self._gathered)
        for lease in hit.shard_leases:
            if lease in self._leases and lease not in waiting:
                self._gathered.append(lease)
                waiting.add(lease)
        if len(self._gathered) >= RELEASE_GATHER_LEASES_MAX:
            self._give_back_gathered()
        elif self._gathered and self._gather_timer is None:
            loop = asyncio.get_running_loop()
            self._gather_timer = loop.call_later(RELEASE_GATHER_MS / 1000, self._give_back_gathered)

    def _give_back_gathered(self) -> None:
        """Send the gathered leases (one `_release_leases`: batched per shard and instance)."""
        if self._gather_timer is not None:
            self._gather_timer.cancel()
            self._gather_timer = None
        leases, self._gathered = self._gathered, []
        if not leases or self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._release_leases(leases, self._gathered_trace))
        self._giving_back.add(task)
        task.add_done_callback(self._giving_back.discard)

    # At most `RELEASES_CONCURRENT_MAX` release requests of this client in flight (made on first use).
    _release_gate: asyncio.Semaphore | None = None

    async def _release_leases(self, leases: Sequence[tuple[int, int]], trace_id: str = "") -> None:
        """Give back those of `leases` ((shard, lease id)) still held: batched per shard, bounded,
        `busy` retried with a budget (`kvfabric.client.releases`). Never raises: a lease not given
        back expires at the directory."""
        held = [lease for lease in leases if self._leases.pop(lease, None) is not None]
        self.metrics.leases_held.set(len(self._leases))
        if self.nc is None or not held:
            return
        if self._release_gate is None:
            self._release_gate = asyncio.Semaphore(RELEASES_CONCURRENT_MAX)
        router = self._router()

        def instance_of(shard: int) -> str | None:
            route = router.route(shard)
            return route.instance if route is not None else None

        async def ask_many(
            instance: str, message: m.LeaseReleaseMany, timeout_s: float, trace_id: str
        ) -> m.DirectoryReply:
            headers = {TRACE_ID_HEADER: trace_id} if trace_id else None
            return await router.ask_instance(instance, RELEASE_MANY_VERB, message, timeout_s, headers=headers)

        await give_back(
            self._ask_directory,
            self.settings.holder_id,
            held,
            gate=self._release_gate,
            timeout_s=self.settings.lookup_timeout_ms / 1000,
            trace_id=trace_id,
            instance_of=instance_of,
            ask_many=ask_many,
            refused=self._lookup_many_refused,
        )

    def _router(self) -> DirectoryRouter:
        if self.router is None:
            raise Unavailable("client not started")
        return self.router

    async def _ask_directory(
        self, verb: str, message: m.DirectoryRequest, timeout_s: float, trace_id: str, shard: int
    ) -> m.DirectoryReply:
        """One directory request to the leader of `shard`. A reply from an older epoch than one
        already seen for the shard comes from a replaced leader (fenced, its view is stale):
        `StaleGeneration`, never used (`DirectoryRouter`)."""
        return await self._router().ask(
            shard, verb, message, timeout_s, headers={TRACE_ID_HEADER: trace_id} if trace_id else None
        )

    # ---- load ------------------------------------------------------------------------------

    async def load(
        self,
        hit: Hit,
        dests: Sequence[Sequence[Destination]],
        *,
        first_chunk: int = 0,
        dest_ids: Sequence[Sequence[DestId]] | None = None,
        gate: WriteGate | None = None,
    ) -> LoadResult:
        """Copy chunks `first_chunk ..` of `hit` into `dests[i][j]` (chunk first_chunk+i, member
        j), verifying every checksum. Returns the verified whole-chunk prefix, in tokens from 0.

        `dest_ids` name the engine's buffers (e.g. paged-KV block ids) so the fence can tell a
        reused buffer; by default each call's buffers are anonymous. `gate`: the loan of `dests`
        (made here when not given); the caller may close it from any thread to take the buffers
        back at once (`KvClient.load` does when the loop is late). Raises `BadRequest` only for
        caller bugs (shapes, sizes)."""
        if not 0 <= first_chunk <= hit.chunks:
            raise BadRequest(f"first_chunk {first_chunk} outside the hit's 0..{hit.chunks} chunks")
        chunks = hit.objects[first_chunk:]
        if len(dests) > len(chunks) or any(len(d) != len(hit.members) for d in dests):
            raise BadRequest(f"dests must be at most {len(chunks)} chunks of {len(hit.members)} members each")
        chunks = chunks[: len(dests)]
        # The engine lends its buffers until this call returns: transfers write into them
        # under `gate`, which the finally below closes (after it, nothing writes into them).
        gate = gate or WriteGate()
        views = [
            scatter_dests(row, [loc.size_bytes for loc in locs], gate)
            for row, locs in zip(dests, chunks, strict=True)
        ]
        tpc = hit.tokens_per_chunk
        if not chunks:
            return LoadResult(first_chunk * tpc, 0, 0)
        if self._closed:
            self.metrics.fallbacks.labels("closed").inc()
            return LoadResult(
                first_chunk * tpc, 0, 0, tuple(range(first_chunk, first_chunk + len(chunks))), "closed"
            )
        started = time.perf_counter()
        self._perform(self.table.expire(_now_ms()))  # also trims the table's deadline heap
        seq = next(self._load_seq)
        generation = RequestGeneration(next(self._generations))
        deadline_ms = _now_ms() + self.settings.load_timeout_ms
        outcomes: dict[tuple[int, int], asyncio.Future[str]] = {}
        anonymous: list[DestId] = []
        waits = [0.0]  # seconds this load queued for transfer room
        loop = asyncio.get_running_loop()
        try:
            for i, locs in enumerate(chunks):
                chunk = first_chunk + i
                for j, loc in enumerate(locs):
                    load_id = (seq, chunk, j)
                    if dest_ids is not None:
                        dest_id = dest_ids[i][j]
                    else:
                        dest_id = ("anonymous", seq, chunk, j)
                        anonymous.append(dest_id)
                    object_id = (hit.groups[chunk], hit.members[j])
                    future: asyncio.Future[str] = loop.create_future()
                    outcomes[(chunk, j)] = future
                    self._waiters[load_id] = _Waiter(future, views[i][j], deadline_ms)
                    await self._want(load_id, generation, object_id, dest_id, loc, deadline_ms, waits)
                if any(f.done() and f.result() != "ok" for f in outcomes.values()):
                    break  # a chunk already failed: later ones would not be used
            self._flush_starts()
            pending = [f for f in outcomes.values() if not f.done()]
            if pending:
                timeout_s = max(0.0, (deadline_ms - _now_ms()) / 1000)
                await asyncio.wait(pending, timeout=timeout_s)
        finally:
            # Every waiter of this load ends here (also when this coroutine is cancelled): after
            # the gate closes no transfer writes into this load's buffers (one that is still
            # running stops at its next block), and the table fences any later delivery.
            gate.close()
            self._flush_starts()  # started transfers must be answered (and release their target)
            timed_out = _now_ms() >= deadline_ms
            for (chunk, j), future in outcomes.items():
                if not future.done():
                    load_id = (seq, chunk, j)
                    self._perform(self.table.cancel(load_id))
                    self._finish(load_id, "timeout" if timed_out else "cancelled")
            for dest_id in anonymous:
                self.table.forget_dest(dest_id)
        return self._load_result(hit, first_chunk, len(chunks), outcomes, started, waits[0])

    def load_now(
        self, hit: Hit, dests: Sequence[Sequence[Destination]], *, first_chunk: int = 0
    ) -> LoadResult | None:
        """`load` done on the calling thread, with no thread hop, for a small hit: chunks
        `first_chunk ..` of at most `LOCAL_INLINE_BYTES_MAX` bytes in all (and no more than
        `load_inflight_bytes_max`) whose first replicas lie on one segment. Co-located, a pooled
        connection that maps the arena copies them (`SegmentPool.fetch_local_now`: no I/O);
        else one data request for all of them on this thread (`SegmentPool.fetch_many`, what a
        worker thread would run for them, the next replicas tried within `load_timeout_ms`,
        through the pool's per-segment connection bound). Returns the verified whole-chunk
        prefix as `load` does (a chunk that did not verify and the ones after it failed); None
        when the hit is not such a load (the caller runs `load`). Thread-safe (the sync facade
        calls it from the engine's thread): it touches no load-table state, so such loads are
        neither coalesced with concurrent loads of the same objects nor counted in the table's
        in-flight bounds (they write only into the caller's buffers). Every copy and transfer
        ends before it returns: nothing writes into `dests` afterwards (invariant 3)."""
        if self._closed or not 0 <= first_chunk <= hit.chunks:
            return None
        chunks = hit.objects[first_chunk:]
        if len(dests) > len(chunks) or any(len(d) != len(hit.members) for d in dests):
            return None  # `load` raises BadRequest for it
        chunks = chunks[: len(dests)]
        locations = [loc for row in chunks for loc in row]
        small = min(LOCAL_INLINE_BYTES_MAX, self.settings.load_inflight_bytes_max)
        if not locations or sum(loc.size_bytes for loc in locations) > small:
            return None  # the table's way: bounded in flight, waits for room, coalesced
        if len({loc.replicas[0].data_addr if loc.replicas else "" for loc in locations}) != 1:
            return None
        started = time.perf_counter()
        gate = WriteGate()
        try:
            views = [
                view
                for row, locs in zip(dests, chunks, strict=True)
                for view in scatter_dests(row, [loc.size_bytes for loc in locs], gate)
            ]
            causes = self.pool.fetch_local_now(locations, views) if self.settings.use_shm else None
            if causes is None:
                deadline_s = time.monotonic() + self.settings.load_timeout_ms / 1000
                causes = self.pool.fetch_many(
                    locations, views, self.settings.replica_attempts_max, deadline_s
                )
        finally:
            gate.close()
        # The verified whole-chunk prefix (as `load` reports it); a chunk with an object that did
        # not read ok, and every chunk after it, failed (recomputed by the engine).
        width = len(hit.members)
        rows = [causes[i * width : (i + 1) * width] for i in range(len(chunks))]
        loaded = next((i for i, row in enumerate(rows) if any(c != "ok" for c in row)), len(rows))
        cause = next((c for c in rows[loaded] if c != "ok"), "") if loaded < len(rows) else ""
        tpc = hit.tokens_per_chunk
        nbytes = sum(loc.size_bytes for row in chunks[:loaded] for loc in row)
        self.metrics.load_seconds.observe(time.perf_counter() - started)
        self.metrics.queued_seconds.observe(0.0)
        self.metrics.loaded_tokens.inc(loaded * tpc)
        self.metrics.prefill_tokens_saved.inc(loaded * tpc)
        self.metrics.loaded_bytes.inc(nbytes)
        if cause:
            self.metrics.fallbacks.labels(cause).inc()
        failed = tuple(range(first_chunk + loaded, first_chunk + len(chunks)))
        return LoadResult((first_chunk + loaded) * tpc, loaded, nbytes, failed, cause)

    async def _want(
        self,
        load_id: Any,
        generation: RequestGeneration,
        object_id: Any,
        dest_id: DestId,
        location: m.ObjectLocation,
        deadline_ms: int,
        waits: list[float],
    ) -> None:
        """Register one waiter; while the table is full (Busy), wait for a transfer to release
        its target, up to the load's deadline (then the waiter ends "busy")."""
        while True:
            self._locations[object_id] = location  # read by StartTransfer, if this want starts one
            try:
                effects = self.table.want(
                    load_id,
                    generation,
                    object_id,
                    dest_id,
                    now_ms=_now_ms(),
                    deadline_ms=deadline_ms,
                    size_bytes=location.size_bytes,
                )
            except (StaleGeneration, BadRequest):
                # Refused for good (an object larger than load_inflight_bytes_max): waiting for
                # room would only burn the deadline.
                self._locations.pop(object_id, None)
                self._finish(load_id, "busy")
                return
            if not (len(effects) == 1 and isinstance(effects[0], Busy)):
                self._perform(effects, starter=load_id)  # a StartTransfer takes the location
                self._locations.pop(object_id, None)
                return
            self._locations.pop(object_id, None)
            remaining_s = (deadline_ms - _now_ms()) / 1000
            if remaining_s <= 0:
                self._finish(load_id, "busy")
                return
            self._flush_starts()  # what this load started so far must run before we wait for room
            self._capacity.clear()
            queued = time.perf_counter()
            try:
                await asyncio.wait_for(self._capacity.wait(), remaining_s)
            except TimeoutError:
                self._finish(load_id, "busy")
                return
            finally:
                waits[0] += time.perf_counter() - queued

    def _load_result(
        self,
        hit: Hit,
        first_chunk: int,
        n_chunks: int,
        outcomes: dict[tuple[int, int], asyncio.Future[str]],
        started: float,
        queued_s: float,
    ) -> LoadResult:
        loaded = 0
        cause = ""
        failed: list[int] = []
        for i in range(n_chunks):
            chunk = first_chunk + i
            results = [
                outcomes[(chunk, j)].result() if (chunk, j) in outcomes else "skipped"
                for j in range(len(hit.members))
            ]
            bad = next((r for r in results if r != "ok"), None)
            if bad is None and not failed:
                loaded += 1
                continue
            if bad is not None and not cause:
                cause = bad if bad != "skipped" else "busy"
            failed.append(chunk)
        nbytes = sum(o.size_bytes for row in hit.objects[first_chunk : first_chunk + loaded] for o in row)
        tokens = (first_chunk + loaded) * hit.tokens_per_chunk
        self.metrics.load_seconds.observe(time.perf_counter() - started)
        self.metrics.queued_seconds.observe(queued_s)
        self.metrics.loaded_tokens.inc(loaded * hit.tokens_per_chunk)
        self.metrics.prefill_tokens_saved.inc(loaded * hit.tokens_per_chunk)
        self.metrics.loaded_bytes.inc(nbytes)
        if cause:
            self.metrics.fallbacks.labels(cause).inc()
        return LoadResult(tokens, loaded, nbytes, tuple(failed), cause)

    # ---- effects of the load table (loop thread only) --------------------------------------

    def _perform(self, effects: list[Effect], starter: Any = None) -> None:
        """Carry out the table's effects; `starter` is the load id whose `want` they answer
        (a StartTransfer writes into that waiter's buffers)."""
        for effect in effects:
            if isinstance(effect, StartTransfer):
                self._start_transfer(effect, starter)
            elif isinstance(effect, Deliver):
                self._deliver(effect)
            elif isinstance(effect, Fail):
                self._finish(effect.load_id, effect.cause)
            elif isinstance(effect, Busy):
                self._finish(effect.load_id, "busy")
            elif isinstance(effect, ReleaseStaging):
                self._targets.pop(effect.transfer_id, None)
                self._capacity.set()  # loads waiting for room may retry
            elif isinstance(effect, CancelTransfer):
                pass  # a blocking transfer cannot be interrupted; it is bounded by its timeout

    def _finish(self, load_id: Any, outcome: str) -> None:
        waiter = self._waiters.pop(load_id, None)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(outcome)

    def _start_transfer(self, effect: StartTransfer, starter: Any) -> None:
        location = self._locations.pop(effect.object_id)
        waiter = self._waiters[starter]  # the want that started it: its buffers, its gate
        self._targets[effect.transfer_id] = _Target(starter, waiter.dest)
        self._starting.append((effect.transfer_id, location, waiter.dest, waiter.deadline_ms))

    def _flush_starts(self) -> None:
        """Dispatch the transfers started since the last flush to the worker threads, batched
        per segment (see `FETCH_BATCH_BYTES_TARGET`). Every one is answered once."""
        if not self._starting:
            return
        starting, self._starting = self._starting, []
        by_segment: dict[str, list[tuple[TransferId, m.ObjectLocation, ScatterDest, int]]] = {}
        for item in starting:
            addr = item[1].replicas[0].data_addr if item[1].replicas else ""
            by_segment.setdefault(addr, []).append(item)
        loop = asyncio.get_running_loop()
        attempts = self.settings.replica_attempts_max

        def done(transfer_ids: list[TransferId], causes: list[str]) -> None:
            for transfer_id, cause in zip(transfer_ids, causes, strict=True):
                self._perform(self.table.transfer_done(transfer_id, cause == "ok", cause))

        for items in by_segment.values():
            largest = max(item[1].size_bytes for item in items)
            per_request = max(1, min(FETCH_BATCH_OBJECTS_MAX, FETCH_BATCH_BYTES_TARGET // max(1, largest)))
            for start in range(0, len(items), per_request):
                batch = items[start : start + per_request]
                transfer_ids = [item[0] for item in batch]
                if (
                    self.settings.use_shm
                    and sum(item[1].size_bytes for item in batch) <= LOCAL_INLINE_BYTES_MAX
                ):
                    # Small co-located reads: copied from the arena here, no hop to a worker thread.
                    causes_now = self.pool.fetch_local_now([it[1] for it in batch], [it[2] for it in batch])
                    if causes_now is not None:
                        loop.call_soon(done, transfer_ids, causes_now)  # answered after this flush
                        continue

                def run(batch: list[tuple[TransferId, m.ObjectLocation, ScatterDest, int]] = batch) -> None:
                    ids = [item[0] for item in batch]
                    if all(dest.gate is not None and not dest.gate.is_open for _, _, dest, _ in batch):
                        # Their loads ended before a worker got to them: nothing to read for.
                        with contextlib.suppress(RuntimeError):
                            loop.call_soon_threadsafe(done, ids, ["cancelled"] * len(batch))
                        return
                    try:
                        causes = self.pool.fetch_many(
                            [loc for _, loc, _, _ in batch],
                            [st for _, _, st, _ in batch],
                            attempts,
                            max(item[3] for item in batch) / 1000,  # a replica's share of it
                        )
                    except Exception:  # never leave a transfer unanswered
                        causes = ["transport_error"] * len(batch)
                    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                        loop.call_soon_threadsafe(done, ids, causes)

                try:
                    self._executor.submit(run)
                except RuntimeError:  # executor shut down
                    loop.call_soon(done, transfer_ids, ["closed"] * len(batch))

    def _deliver(self, effect: Deliver) -> None:
        target = self._targets[effect.transfer_id]
        waiter = self._waiters.get(effect.load_id)
        if waiter is None or not self.table.may_write(effect.load_id, effect.generation, effect.dest_id):
            return
        if target.dest is not waiter.dest:
            # A load that joined another's transfer copies from that load's buffers, which are
            # still lent only while its gate is open (all on the loop thread: nothing interleaves).
            try:
                if target.dest.gate is not None and not target.dest.gate.is_open:
                    raise GateClosed
                waiter.dest.copy_from(target.dest)  # under the joiner's own gate
            except GateClosed:
                self._perform(self.table.cancel(effect.load_id))
                self._finish(effect.load_id, "cancelled")
                return
        self._perform(self.table.delivered(effect.load_id, effect.generation, effect.dest_id))
        self._finish(effect.load_id, "ok")

    # ---- save ------------------------------------------------------------------------------

    def save_admission(self, size_bytes: int) -> str | None:
        """Why a save of `size_bytes` would be dropped now, or None when it may start."""
        if self._closed:
            return "closed"
        if self._saves_running >= self.settings.saves_queued_max:
            return "queue_full"
        if self._save_bytes + size_bytes > self.settings.save_inflight_bytes_max:
            return "bytes"
        return None

    async def save(
        self,
        tokens: TokenIds,
        objects: Sequence[Sequence[Source]],
        *,
        first_chunk: int = 0,
        extras: ChunkExtras | None = None,
        trace_id: str | None = None,
    ) -> SaveResult:
        """Publish chunks `first_chunk ..` of `tokens`: `objects[i][j]` is chunk first_chunk+i's
        bytes for member j. Two-phase: put_begin -> write every replica -> put_commit; any failed
        chunk is aborted (nothing half-visible). Never raises for cluster failures."""
        groups = self.chunk_groups(tokens, extras)
        members = self.spec.required_members()
        if first_chunk < 0 or first_chunk + len(objects) > len(groups):
            raise BadRequest(
                f"chunks {first_chunk}..{first_chunk + len(objects)} exceed the {len(groups)} full chunks"
            )
        if any(len(row) != len(members) for row in objects):
            raise BadRequest(f"each chunk needs {len(members)} member objects")
        views = [[memoryview(o).cast("B") for o in row] for row in objects]
        size = sum(len(v) for row in views for v in row)
        refused = self.save_admission(size)
        if refused is not None:
            self.metrics.saves_dropped.labels(refused).inc()
            return SaveResult(chunks_failed=len(objects), causes={refused: len(objects)})
        self._save_bytes += size
        self._saves_running += 1
        self.metrics.inflight_bytes.set(self._save_bytes)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)  # close() waits for running saves before draining NATS
        started = time.perf_counter()
        try:
            return await self._save(groups, members, views, first_chunk, trace_id or uuid.uuid4().hex)
        finally:
            self._save_bytes -= size
            self._saves_running -= 1
            if task is not None:
                self._tasks.discard(task)
            self.metrics.inflight_bytes.set(self._save_bytes)
            self.metrics.save_seconds.observe(time.perf_counter() - started)

    async def _save(
        self,
        groups: list[ChunkGroupId],
        members: tuple[MemberId, ...],
        views: list[list[memoryview]],
        first_chunk: int,
        trace_id: str,
    ) -> SaveResult:
        """The phases of `kvfabric.client.saves` (which decides), with this client's I/O."""
        plan = plan_save(groups, members, views, first_chunk)
        if not plan.keys:
            return SaveResult()
        loop = asyncio.get_running_loop()
        if sum(len(v) for v in plan.data.values()) <= SAVE_INLINE_CHECKSUM_BYTES_MAX:
            digests = [checksum(plan.data[k]) for k in plan.keys]  # cheaper than a thread hop
        else:
            digests = await loop.run_in_executor(
                self._save_executor, lambda: [checksum(plan.data[k]) for k in plan.keys]
            )
        router = self._router()
        try:
            await router.known_shards()
        except Unavailable:
            chunks = len(plan.chunks)
            return SaveResult(chunks_failed=chunks, causes={"directory_unavailable": chunks})
        tally = SaveTally(plan)
        specs = object_specs(plan, digests)
        # Begin: shared with the other saves in flight (`SharedCalls`); each write names the
        # request's trace id and how many of its writes its segment may confirm together.
        writes: list[tuple[m.BeginResult, m.WriteTicket, str, int]] = []
        placed: list[m.BeginResult] = []
        for batch, (reply, batch_trace) in await self._shared(self._begins, specs, _spec_key, trace_id):
            if not isinstance(reply, m.PutBeginReply):
                tally.refused([spec.key for spec in batch], str(reply))
                continue
            mine = {spec.key for spec in batch}
            ours = tally.begun(r for r in reply.results if r.key in mine)
            together = confirm_counts(
                (r for r in reply.results if r.status == "placed"), router.shard_of, self._writes_at_once
            )
            placed += ours
            writes += [
                (r, t, batch_trace, together[t.segment_id, router.shard_of(r.key)])
                for r in ours
                for t in r.tickets
            ]
        outcomes = await self._write_all(plan, writes)
        ok_keys, bad_keys = tally.wrote(placed, [cause for cause, _ in outcomes])
        commits = with_receipts(
            ok_keys,
            ((result.key, receipt) for (result, *_), (_, receipt) in zip(writes, outcomes, strict=True)),
        )
        # Aborts and commits go to their shards concurrently (they name different keys). An abort
        # that fails needs nothing more: its placements expire at the directory (write_ttl_ms).
        ended: tuple[Any, list[tuple[list[tuple[bytes, list[m.WriteReceipt]]], tuple[object, str]]]]
        ended = await asyncio.gather(
            self._shared(self._aborts, bad_keys, _same_key, trace_id),
            self._shared(self._commits, commits, _commit_key, trace_id),
        )
        for items, (reply, _) in ended[1]:
            keys = [key for key, _ in items]
            if not isinstance(reply, m.PutCommitReply):
                tally.refused(keys, str(reply))
                continue
            mine = set(keys)
            tally.commits(r for r in reply.results if r.key in mine)
        result = tally.result()
        self.metrics.saved_tokens.inc(result.chunks_saved * self.spec.layout.tokens_per_chunk)
        self.metrics.saved_bytes.inc(result.bytes_written)
        for cause, n in result.causes.items():
            self.metrics.save_failures.labels(cause).inc(n)
        return result

    async def _write_all(
        self, plan: SavePlan, writes: Sequence[tuple[m.BeginResult, m.WriteTicket, str, int]]
    ) -> list[tuple[str, m.WriteReceipt | None]]:
        """Write every replica of every placed object (bounded by the save executor's threads),
        each answered with its segment's write receipt (the commit carries them); per write, its
        outcome. Each segment's writes are pipelined on one connection (`write_streams`,
        `SegmentPool.write_many`; staged through its staging file when co-located)."""
        loop = asyncio.get_running_loop()
        streams = write_streams(
            [(t.data_addr, t.size_bytes) for _, t, _, _ in writes], SAVE_WRITE_STREAM_BYTES_TARGET
        )

        def run(stream: list[int]) -> list[tuple[str, m.WriteReceipt | None]]:
            (result, ticket, trace, together), *_ = (writes[i] for i in stream)
            if len(stream) == 1:  # on its own connection: staged when co-located
                return [self.pool.write(ticket, plan.data[result.key], trace, together, receipt=True)]
            mine = [
                (t, plan.data[r.key], trace, together)
                for r, t, trace, together in (writes[i] for i in stream)
            ]
            return self.pool.write_many(mine, receipt=True)

        answers = await asyncio.gather(*(loop.run_in_executor(self._save_executor, run, s) for s in streams))
        outcomes: list[tuple[str, m.WriteReceipt | None]] = [("unanswered", None)] * len(writes)
        for stream, answer in zip(streams, answers, strict=True):
            for i, outcome in zip(stream, answer, strict=True):
                outcomes[i] = outcome
        return outcomes

    async def _shared(
        self, calls: SharedCalls[T], items: Sequence[T], key_of: Callable[[T], bytes], trace_id: str
    ) -> list[tuple[list[T], tuple[object, str]]]:
        """`calls`' verb for `items`, split per shard in batches (`_shard_batches`), each sharing a
        request with other saves' (`SharedCalls`), concurrently; (batch, (reply or cause, the
        request's trace id)) in batch order."""
        router = self._router()
        deadline_s = time.monotonic() + self.settings.save_timeout_ms / 1000
        batches = list(_shard_batches(items, lambda item: router.shard_of(key_of(item)), calls.batch_max))
        replies = await asyncio.gather(
            *(
                calls.call(shard, batch, [key_of(item) for item in batch], trace_id, deadline_s)
                for shard, _, batch in batches
            )
        )
        return [(batch, reply) for (_, _, batch), reply in zip(batches, replies, strict=True)]

    def _save_calls(
        self, verb: str, message: Callable[[str, list[Any]], m.DirectoryRequest], batch_max: int
    ) -> SharedCalls[Any]:
        """The shared requests of one save-path verb: `message(request id, items)`."""

        async def send(shard: int, items: list[Any], trace_id: str, deadline_s: float) -> object:
            return await self._directory(trace_id, verb, message(uuid.uuid4().hex, items), shard, deadline_s)

        return SharedCalls(send, batch_max)

    # Bounds this client's save-path directory requests in flight (made on first use, on the loop).
    _save_gate: asyncio.Semaphore | None = None

    async def _directory(
        self,
        trace_id: str,
        verb: str,
        message: m.DirectoryRequest,
        shard: int,
        deadline_s: float | None = None,
    ) -> object:
        """A directory call for saves: the reply, or a cause string (never raises). At most
        `SAVE_DIRECTORY_CALLS_MAX` in flight per client; `busy` backs off and asks again, until
        `deadline_s` (monotonic; by default `save_timeout_ms` from now)."""
        if self.nc is None:
            return "closed"
        if self._save_gate is None:
            self._save_gate = asyncio.Semaphore(SAVE_DIRECTORY_CALLS_MAX)
        gate = self._save_gate
        if deadline_s is None:
            deadline_s = time.monotonic() + self.settings.save_timeout_ms / 1000

        async def ask() -> m.DirectoryReply:
            # The wait for a slot and the request share the save's deadline (TimeoutError below).
            async with asyncio.timeout(max(0.0, deadline_s - time.monotonic())), gate:
                left_s = max(0.001, deadline_s - time.monotonic())
                return await self._ask_directory(verb, message, left_s, trace_id, shard)

        try:
            return await retry_busy(
                ask,
                attempts_max=SAVE_BUSY_ATTEMPTS_MAX,
                deadline_s=deadline_s,
                on_retry=self.metrics.busy_retries.inc,
            )
        except (KvfError, TimeoutError) as exc:
            return directory_cause(exc)

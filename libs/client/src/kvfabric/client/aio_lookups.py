"""`AsyncKvClient`'s lookups and lease give-backs: the folded hit over the shards, read-leased, and
the leases given back now (`release`) or gathered (`release_soon`); see `kvfabric.client.aio`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Final

from kvfabric.client.aio_base import ClientBase, directory_cause
from kvfabric.client.hits import Hit
from kvfabric.client.releases import RELEASES_CONCURRENT_MAX, give_back
from kvfabric.cluster.lookups import RELEASE_MANY_VERB, lookup_prefix
from kvfabric.format.errors import KvfError
from kvfabric.format.key import ChunkExtras, ChunkGroupId, MemberId, TokenIds
from kvfabric.proto import directory as m
from kvfabric.proto.common import TRACE_ID_HEADER, trace_id_of

# `_prune_leases`: how often the leases past their expiry are forgotten, and the margin kept for
# the skew between this host's clock and the directory's (which wrote the expiries)
LEASES_PRUNE_EVERY_S: Final = 5.0
LEASES_PRUNE_MARGIN_MS: Final = 30_000

# Releases an engine does not wait for (`release_soon`, what `KvClient.release` does) are gathered
# for up to `RELEASE_GATHER_MS` and given back together, at once when `RELEASE_GATHER_LEASES_MAX`
# are waiting (one full `lease_release` batch): a prompt's release is then no directory request of
# its own competing with the engine's next lookup (NATS, the directory and this loop share 2 cores
# here). A gathered lease is still held (`_leases`): `close` gives it back with the rest; a lease
# held this much longer only delays the eviction of what it covers.
RELEASE_GATHER_MS: Final = 20
RELEASE_GATHER_LEASES_MAX: Final = m.RELEASE_BATCH_LEASES_MAX
# The share of `lookup_timeout_ms` the shards get to answer; the rest is for merging them and
# giving back the leases not needed (`lookup_prefix`).
LOOKUP_SHARDS_BUDGET: Final = 0.8


class LookupMixin(ClientBase):
    """`lookup`, `release`, `release_soon` of `AsyncKvClient`."""

    _leases_pruned_s: float  # `_prune_leases`: when last (monotonic)
    _gathered: list[tuple[int, int]]  # `release_soon`: leases for the next give-back (still in `_leases`)
    _gathered_trace: str  # the trace id the gathered give-back is sent with
    _gather_timer: asyncio.TimerHandle | None
    _giving_back: set[asyncio.Task[None]]  # gathered give-backs in flight (`close` waits for them)
    _lookups: set[asyncio.Task[object]]  # lookups in flight (`close` waits for them before the drain)

    async def lookup(
        self,
        tokens: TokenIds,
        *,
        max_tokens: int | None = None,
        extras: ChunkExtras | None = None,
        trace_id: str | None = None,
    ) -> Hit:
        """The folded hit for `tokens` (at most `max_tokens`), read-leased. Never raises for a
        cluster failure: the hit is empty with `cause` set. Cancelled, what the directory granted
        it is given back once its requests answer (`kvfabric.cluster.lookups.lookup_prefix`)."""
        task = asyncio.current_task()
        if task is not None:  # `close` lets it end (its leases given back) before NATS drains
            self._lookups.add(task)
        try:
            return await self._lookup(tokens, max_tokens, extras, trace_id)
        finally:
            if task is not None:
                self._lookups.discard(task)

    async def _lookup(
        self, tokens: TokenIds, max_tokens: int | None, extras: ChunkExtras | None, trace_id: str | None
    ) -> Hit:
        groups = self.chunk_groups(tokens, extras)
        tpc = self.spec.layout.tokens_per_chunk
        if max_tokens is not None:
            groups = groups[: max(0, max_tokens) // tpc]
        groups = groups[: m.LOOKUP_BATCH_GROUPS_MAX]
        members = self.spec.required_members()
        trace_id = trace_id_of(trace_id)
        empty = Hit(0, tpc, tuple(groups), members, trace_id=trace_id)
        self.metrics.lookups.inc()
        if not groups:
            return empty
        if self.nc is None or self._closed:
            return self._fallback(empty, "closed")
        started = time.perf_counter()
        try:
            # One deadline for the whole lookup: each request had its own `lookup_timeout_ms`,
            # and a failover's refresh, retries and singles after a late `lookup_many` took
            # 2-3 x it, past the sync client's bound (review, stop 68). Cut, the requests still
            # out give their leases back when answered (`lookup_prefix`).
            async with asyncio.timeout(self.settings.lookup_timeout_ms / 1000):
                hit_chunks, objects, leases, expires = await self._lookup_shards(groups, members, trace_id)
        except TimeoutError:
            return self._fallback(empty, "directory_timeout")
        except KvfError as exc:
            return self._fallback(empty, directory_cause(exc, other="directory_error"))
        finally:
            self.metrics.lookup_seconds.observe(time.perf_counter() - started)
        if self._closed:  # closed meanwhile: close gave back what it held, these leases too
            for lease in leases:
                self._leases[lease] = expires  # held, so that `_release_leases` gives it back
            await self._release_leases(leases, trace_id)
            return self._fallback(empty, "closed")
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
        self._prune_leases()
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

    def _prune_leases(self) -> None:
        """At most every `LEASES_PRUNE_EVERY_S`: forget the leases past their expiry (the
        directory's clock, less `LEASES_PRUNE_MARGIN_MS` for the clocks' skew): the directory
        expired them. A hit an engine never released stayed counted held for good (the
        `leases_held` gauge), and the table grew by each (review, stop 67). Leases being given
        back (expiry 0) stay until their answer."""
        now_s = time.monotonic()
        if now_s - self._leases_pruned_s < LEASES_PRUNE_EVERY_S:
            return
        self._leases_pruned_s = now_s
        cutoff_ms = int(time.time() * 1000) - LEASES_PRUNE_MARGIN_MS
        for lease in [lease for lease, expires in self._leases.items() if 0 < expires < cutoff_ms]:
            del self._leases[lease]

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
            # In the background, as gathered releases are (`close` waits for them): awaited
            # here, a slow directory's release answers made a lookup take 3-4 x
            # `lookup_timeout_ms`, past the sync client's bound (review, 2026-12-06).
            task = asyncio.get_running_loop().create_task(self._release_leases(leases, trace_id))
            self._giving_back.add(task)
            task.add_done_callback(self._giving_back.discard)

        hit = await lookup_prefix(
            self._router(),
            [g.group_id() for g in groups],
            holder_id=self.settings.holder_id,
            members=[m.Member(*member) for member in members],
            lease_ttl_ms=self.settings.lease_ttl_ms,
            timeout_s=self.settings.lookup_timeout_ms / 1000,
            trace_id=trace_id,
            refused=self._lookup_many_refused,
            give_back=give_back,
            # within the whole lookup's deadline (`_lookup`): a shard failing over misses from
            # its own first chunk, not the whole prefix (review, stop 70)
            budget_s=LOOKUP_SHARDS_BUDGET * self.settings.lookup_timeout_ms / 1000,
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

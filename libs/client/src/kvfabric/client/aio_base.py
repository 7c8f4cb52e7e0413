"""The parts of `AsyncKvClient` (`kvfabric.client.aio`) share this: the engine's identity and buffer
types, the cause a failed directory call counts under, and `ClientBase` (state and directory access)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from nats.aio.client import Client as NatsClient

from kvfabric.client.metrics import ClientMetrics
from kvfabric.client.settings import ClientSettings
from kvfabric.client.transfers import SegmentPool
from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.format.errors import Indeterminate, KvfError, RateLimited, StaleGeneration, Unavailable
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


class ClientBase:
    """What every part of `AsyncKvClient` shares: its settings, engine, metrics, NATS connection,
    segment pool, shard router, the read leases it holds, and its directory requests. Set by
    `AsyncKvClient.__init__` / `start`."""

    settings: ClientSettings
    spec: EngineSpec
    metrics: ClientMetrics
    nc: NatsClient | None
    pool: SegmentPool
    router: DirectoryRouter | None  # the shard map; epochs per shard (fencing)
    _closed: bool
    _leases: dict[tuple[int, int], int]  # (shard, lease id) -> expires_ms (directory clock)
    # directory instances without `lookup_many` / `lease_release_many` (older): shard by shard
    _lookup_many_refused: set[str]

    def chunk_groups(self, tokens: TokenIds, extras: ChunkExtras | None = None) -> list[ChunkGroupId]:
        spec = self.spec
        return chunk_groups_for_prefix(spec.domain, spec.model, spec.layout, tokens, extras)

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

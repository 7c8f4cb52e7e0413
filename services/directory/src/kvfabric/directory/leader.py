"""Leader election for directory shards: `ShardLeadership`'s effects on JetStream KV.

Buckets (created by the first instance, file storage, one value per key):
- `KVF_DIRECTORY_LEADERS`: key `shard-<n>` = the leading instance id. The bucket's max age is
  the leader lease TTL, so a key not rewritten for `lease_ttl_ms` disappears and a standby's
  `create` wins. The revision of the winning `create` is the shard's **epoch**.
- `KVF_DIRECTORY_MEMBERS`: key `member-<instance id>`, rewritten while alive (for operators and
  for rebalancing, off by default: with `rebalance=False` every instance desires every shard,
  so leadership is sticky and moves only when a leader dies).
- `KVF_DIRECTORY_SEGMENTS`: the segment registry (key = segment id, value = its
  `RegisterSegment`), written by the leader on every registration; a new leader reads it to
  know which segments to ask for reports. This is the only durable record the directory keeps.

The core decides; this loop only performs effects and feeds results back. Clocks: monotonic
milliseconds (the core compares its own send times with its own now).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from kvfabric.core.leadership import (
    Acquire,
    AnnounceMember,
    Effect,
    LeadershipConfig,
    Release,
    Renew,
    ShardLeadership,
    StartLeading,
    StopLeading,
    key_of,
    member_key,
)
from kvfabric.proto import directory as m
from kvfabric.runtime.logs import get_logger

__all__ = [
    "CONFIG_BUCKET",
    "LEADERS_BUCKET",
    "MEMBERS_BUCKET",
    "SEGMENTS_BUCKET",
    "LeaderElection",
    "SegmentRegistry",
    "agree_on_shards",
    "monotonic_ms",
]

LEADERS_BUCKET: Final = "KVF_DIRECTORY_LEADERS"
MEMBERS_BUCKET: Final = "KVF_DIRECTORY_MEMBERS"
SEGMENTS_BUCKET: Final = "KVF_DIRECTORY_SEGMENTS"
CONFIG_BUCKET: Final = "KVF_DIRECTORY_CONFIG"
LOOP_MS: Final = 100
KV_TIMEOUT_S: Final = 2.0
REGISTRY_GET_ATTEMPTS_MAX: Final = 3
REGISTRY_GET_RETRY_S: Final = 0.1

_log = get_logger("kvfabric.directory.registry")

OnStart = Callable[[int, int], Awaitable[None]]
OnStop = Callable[[int, int, str], Awaitable[None]]


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


async def _bucket(nc: NatsClient, name: str, ttl_s: float | None, replicas: int = 1) -> KeyValue:
    js = nc.jetstream(timeout=KV_TIMEOUT_S)
    try:
        return await js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        config = KeyValueConfig(
            bucket=name, history=1, ttl=ttl_s, storage=StorageType.FILE, replicas=replicas
        )
        try:
            return await js.create_key_value(config)
        except nats.js.errors.BadRequestError:  # created meanwhile by another instance
            return await js.key_value(name)


async def agree_on_shards(nc: NatsClient, shards: int, replicas: int = 1) -> int:
    """The cluster's shard count, fixed by the first instance that ever started (JetStream KV
    `KVF_DIRECTORY_CONFIG`, key `shards`, no TTL). Returns it; a different count here would
    make two instances lead the same keys under different shard numbers (and free each other's
    slots as orphans), so the caller refuses to start on a mismatch."""
    kv = await _bucket(nc, CONFIG_BUCKET, None, replicas)
    try:
        await kv.create("shards", str(shards).encode())
        return shards
    except nats.js.errors.KeyWrongLastSequenceError:
        entry = await kv.get("shards")
        return int((entry.value or b"0").decode())


class SegmentRegistry:
    """Which segments exist (their latest registration), durable in JetStream KV."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, nc: NatsClient, replicas: int = 1) -> SegmentRegistry:
        return cls(await _bucket(nc, SEGMENTS_BUCKET, None, replicas))

    async def put(self, registration: m.RegisterSegment) -> None:
        await self.kv.put(registration.segment_id, msgspec.msgpack.encode(registration))

    async def get(self, segment_id: str) -> m.RegisterSegment | None:
        """The registration of a segment that heartbeats (so it registered: read as missing only
        from a lagging replica, asked again); None if it never did."""
        entry = await self._get_listed(segment_id)
        return msgspec.msgpack.decode(entry.value, type=m.RegisterSegment) if entry and entry.value else None

    async def all(self) -> list[m.RegisterSegment]:
        try:
            keys = await self.kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        out = []
        for key in sorted(keys):
            entry = await self._get_listed(key)
            if entry is not None and entry.value:
                out.append(msgspec.msgpack.decode(entry.value, type=m.RegisterSegment))
        return out

    async def _get_listed(self, key: str) -> KeyValue.Entry | None:
        """Registrations are never deleted: a key known to exist that reads as missing came from
        a replica still catching up (direct gets on a NATS cluster), so ask again a few times."""
        for attempt in range(REGISTRY_GET_ATTEMPTS_MAX):
            try:
                return await self.kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                await asyncio.sleep(REGISTRY_GET_RETRY_S * (attempt + 1))
        _log.warning("registered_segment_unreadable", segment_id=key)
        return None


class LeaderElection:
    """Runs one instance's `ShardLeadership` against the leaders and members buckets."""

    def __init__(
        self,
        nc: NatsClient,
        instance_id: str,
        config: LeadershipConfig,
        *,
        rebalance: bool = False,
        replicas: int = 1,
    ) -> None:
        self.nc = nc
        self.instance_id = instance_id
        self.config = config
        self.rebalance = rebalance
        self.replicas = replicas  # of the KV buckets it creates (3 on a NATS cluster: survive a node)
        self.core = ShardLeadership(config, instance_id)
        self._leaders: KeyValue | None = None
        self._members: KeyValue | None = None
        self._log = get_logger("kvfabric.directory.leader").bind(instance=instance_id)

    async def open(self) -> None:
        config, replicas = self.config, self.replicas
        self._leaders = await _bucket(self.nc, LEADERS_BUCKET, config.lease_ttl_ms / 1000, replicas)
        self._members = await _bucket(self.nc, MEMBERS_BUCKET, config.members_ttl_ms / 1000, replicas)

    async def run(self, on_start: OnStart, on_stop: OnStop) -> None:
        """Forever: tick the core, perform its effects (StopLeading first), refresh members."""
        await self._perform(self.core.on_members({self.instance_id}, monotonic_ms()), on_start, on_stop)
        while True:
            if self.rebalance:
                members = await self._live_members()
                await self._perform(self.core.on_members(members, monotonic_ms()), on_start, on_stop)
            # Read the clock again: the KV operations just performed fed the core later times.
            await self._perform(self.core.tick(monotonic_ms()), on_start, on_stop)
            await asyncio.sleep(LOOP_MS / 1000)

    async def _live_members(self) -> set[str]:
        assert self._members is not None
        try:
            keys = await self._members.keys()
        except (nats.js.errors.NoKeysError, nats.errors.Error, TimeoutError):
            return {self.instance_id}
        return {k.removeprefix("member-") for k in keys} | {self.instance_id}

    async def _perform(self, effects: list[Effect], on_start: OnStart, on_stop: OnStop) -> None:
        # Stopping comes first: nothing else may run while this instance acts on a lapsed lease.
        for effect in sorted(effects, key=lambda e: not isinstance(e, StopLeading)):
            if isinstance(effect, StopLeading):
                self._log.warning(
                    "leadership_lost", shard=effect.shard, epoch=effect.epoch, reason=effect.reason
                )
                await on_stop(effect.shard, effect.epoch, effect.reason)
            elif isinstance(effect, StartLeading):
                self._log.info("leadership_won", shard=effect.shard, epoch=effect.epoch)
                await on_start(effect.shard, effect.epoch)
            else:
                await self._perform(await self._kv(effect), on_start, on_stop)

    async def _kv(self, effect: Effect) -> list[Effect]:
        assert self._leaders is not None and self._members is not None
        value = self.instance_id.encode()
        sent = monotonic_ms()
        try:
            if isinstance(effect, Acquire):
                revision = await self._leaders.create(key_of(effect.shard), value)
                # When the answer came: a create answered after its term's deadline (this loop
                # stalled meanwhile, another instance may lead by now) is released, not started.
                return self.core.on_acquired(effect.shard, revision, sent, now_ms=monotonic_ms())
            if isinstance(effect, Renew):
                revision = await self._leaders.update(key_of(effect.shard), value, last=effect.revision)
                return self.core.on_renewed(effect.shard, revision, sent, now_ms=monotonic_ms())
            if isinstance(effect, Release):
                await self._leaders.delete(key_of(effect.shard), last=effect.revision)
                return self.core.on_released(effect.shard)
            if isinstance(effect, AnnounceMember):
                await self._members.put(member_key(self.instance_id), b"")
                return []
        except (nats.js.errors.Error, nats.errors.Error, TimeoutError) as exc:
            if isinstance(effect, Acquire):
                return self.core.on_acquire_failed(effect.shard, monotonic_ms())
            if isinstance(effect, Renew):
                self._log.warning("lease_renew_failed", shard=effect.shard, error=type(exc).__name__)
                return self.core.on_renew_failed(effect.shard, monotonic_ms())
            if isinstance(effect, Release):
                return self.core.on_released(effect.shard)  # it lapses by TTL anyway
            return []
        return []

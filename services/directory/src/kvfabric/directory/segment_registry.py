"""The segment registry: which segments exist (each one's latest `RegisterSegment`), durable in
the JetStream KV bucket `KVF_DIRECTORY_SEGMENTS` (key = segment id). The leader of any shard writes
it on every registration, before acknowledging it; a new leader reads it to know which segments
to ask for reports (`kvfabric.directory.rebuild`). This is the only durable record the directory
keeps.
"""

from __future__ import annotations

import asyncio
from typing import Final

import msgspec
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.kv import KeyValue

from kvfabric.directory.kv_buckets import SEGMENTS_BUCKET, open_bucket
from kvfabric.proto import directory as m
from kvfabric.runtime.logs import get_logger

__all__ = ["SegmentRegistry"]

REGISTRY_GET_ATTEMPTS_MAX: Final = 3
REGISTRY_GET_RETRY_S: Final = 0.1

_log = get_logger("kvfabric.directory.registry")


class SegmentRegistry:
    """Which segments exist (their latest registration), durable in JetStream KV."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, nc: NatsClient, replicas: int = 1) -> SegmentRegistry:
        return cls(await open_bucket(nc, SEGMENTS_BUCKET, None, replicas))

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

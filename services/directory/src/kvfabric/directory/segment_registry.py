"""The segment registry: which segments exist (each one's latest `RegisterSegment`), durable in
the JetStream KV bucket `KVF_DIRECTORY_SEGMENTS` (key = segment id). The leader of any shard writes
it on every registration, before acknowledging it; a new leader reads it to know which segments
to ask for reports (`kvfabric.directory.rebuild`). This is the only durable record the directory
keeps.

`all()` lists the bucket from its stream's subjects (`kvfabric.directory.kv_keys`: nats-py's
`keys()` can end a listing early), and adds every registration this process wrote or read that
the listing did not name (registrations are never deleted: a listing only grows). A segment's
incarnations only grow (the directory refuses an older one), so of two registrations of one
segment the higher incarnation is kept: a read from a lagging replica, or from a bucket
recreated since (its revisions start again), never replaces a newer one.
"""

from __future__ import annotations

import asyncio
from typing import Final

import msgspec
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from kvfabric.directory.kv_buckets import KV_TIMEOUT_S, SEGMENTS_BUCKET, open_bucket
from kvfabric.directory.kv_keys import bucket_keys
from kvfabric.proto import directory as m
from kvfabric.runtime.logs import get_logger

__all__ = ["SegmentRegistry"]

REGISTRY_GET_ATTEMPTS_MAX: Final = 3
REGISTRY_GET_RETRY_S: Final = 0.1

_log = get_logger("kvfabric.directory.registry")


class SegmentRegistry:
    """Which segments exist (their latest registration), durable in JetStream KV."""

    def __init__(self, kv: KeyValue, js: JetStreamContext, bucket: str = SEGMENTS_BUCKET) -> None:
        self.kv = kv
        self.js = js
        self.bucket = bucket
        # segment id -> the newest registration this process wrote or read. Bounded by the
        # segments ever registered, as the bucket is (nothing is deleted from either).
        self._seen: dict[str, m.RegisterSegment] = {}

    @classmethod
    async def open(cls, nc: NatsClient, replicas: int = 1) -> SegmentRegistry:
        kv = await open_bucket(nc, SEGMENTS_BUCKET, None, replicas)
        return cls(kv, nc.jetstream(timeout=KV_TIMEOUT_S))

    async def put(self, registration: m.RegisterSegment) -> None:
        await self.kv.put(registration.segment_id, msgspec.msgpack.encode(registration))
        self._remember(registration)

    async def get(self, segment_id: str) -> m.RegisterSegment | None:
        """The registration of a segment that heartbeats (so it registered: read as missing only
        from a lagging replica, asked again); None if it never did."""
        return await self._read(segment_id)

    async def all(self) -> list[m.RegisterSegment]:
        """Every registration: the bucket's, and any this process saw that it did not name."""
        for key in await bucket_keys(self.js, self.bucket):
            await self._read(key)
        return [self._seen[segment_id] for segment_id in sorted(self._seen)]

    async def _read(self, segment_id: str) -> m.RegisterSegment | None:
        """The newest of what the bucket holds now and what this process saw before."""
        entry = await self._get_listed(segment_id)
        if entry is not None and entry.value:
            self._remember(msgspec.msgpack.decode(entry.value, type=m.RegisterSegment))
        return self._seen.get(segment_id)

    def _remember(self, registration: m.RegisterSegment) -> None:
        seen = self._seen.get(registration.segment_id)
        if seen is None or seen.incarnation <= registration.incarnation:
            self._seen[registration.segment_id] = registration

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

"""The directory's JetStream KV buckets: their names, opening them on a forming cluster, and the
cluster's shard count (`agree_on_shards`).

Buckets (created by the first instance, file storage, one value per key):
- `KVF_DIRECTORY_LEADERS`: key `shard-<n>` = the leading instance id; its max age is the leader
  lease TTL (`kvfabric.directory.leader`).
- `KVF_DIRECTORY_MEMBERS`: key `member-<instance id>`, rewritten while alive
  (`kvfabric.directory.leader`).
- `KVF_DIRECTORY_SEGMENTS`: the segment registry (`kvfabric.directory.segment_registry`).
- `KVF_DIRECTORY_CONFIG`: `shards`, fixed by the first instance that ever started
  (`agree_on_shards`), and the floors `kvfabric.directory.kv_doctor` claims.

## Opening the buckets on a forming cluster
`create_key_value` on a NATS cluster whose peers are still joining is refused (a 400:
insufficient resources, no suitable peers) or unanswered; `open_bucket` tries again with a
bounded backoff until `BUCKET_OPEN_TIMEOUT_S` has passed, and takes a bucket created meanwhile
by another instance.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from kvfabric.directory.kv_doctor import floor_of, kv_stream_config
from kvfabric.runtime.logs import get_logger

__all__ = [
    "CONFIG_BUCKET",
    "LEADERS_BUCKET",
    "MEMBERS_BUCKET",
    "SEGMENTS_BUCKET",
    "agree_on_shards",
    "open_bucket",
    "retrying",
]

LEADERS_BUCKET: Final = "KVF_DIRECTORY_LEADERS"
MEMBERS_BUCKET: Final = "KVF_DIRECTORY_MEMBERS"
SEGMENTS_BUCKET: Final = "KVF_DIRECTORY_SEGMENTS"
CONFIG_BUCKET: Final = "KVF_DIRECTORY_CONFIG"
KV_TIMEOUT_S: Final = 2.0
BUCKET_OPEN_TIMEOUT_S: Final = 30.0  # `open_bucket` gives up after this (the instance exits, restarted)
BUCKET_RETRY_S: Final = 0.2  # first wait between tries, doubled up to BUCKET_RETRY_S_MAX
BUCKET_RETRY_S_MAX: Final = 2.0

_log = get_logger("kvfabric.directory.registry")

T = TypeVar("T")


async def open_bucket(
    nc: NatsClient,
    name: str,
    ttl_s: float | None,
    replicas: int = 1,
    *,
    timeout_s: float = BUCKET_OPEN_TIMEOUT_S,
    clock: Callable[[], float] = time.monotonic,
) -> KeyValue:
    """Open the bucket, creating it if missing; on a refusal or no answer (a forming cluster)
    try again with a bounded backoff until `timeout_s` (module docstring)."""
    js = nc.jetstream(timeout=KV_TIMEOUT_S)
    config = KeyValueConfig(bucket=name, history=1, ttl=ttl_s, storage=StorageType.FILE, replicas=replicas)

    async def open_or_create() -> KeyValue:
        try:
            return await js.key_value(name)
        except nats.js.errors.BucketNotFoundError:
            # A bucket recreated after a kept write error starts above its old revisions
            # (kv_doctor): never again from 1, where epochs already used would come back.
            floor = await floor_of(nc, f"KV_{name}", CONFIG_BUCKET)
            if floor is None:
                return await js.create_key_value(config)  # a 400 if created meanwhile: read it next
            _log.warning("kv_bucket_recreated_from_floor", bucket=name, first_seq=floor)
            await js.add_stream(kv_stream_config(name, ttl_s, replicas, floor))
            return await js.key_value(name)

    return await retrying(name, open_or_create, timeout_s=timeout_s, clock=clock)


async def agree_on_shards(nc: NatsClient, shards: int, replicas: int = 1) -> int:
    """The cluster's shard count, fixed by the first instance that ever started (JetStream KV
    `KVF_DIRECTORY_CONFIG`, key `shards`, no TTL). Returns it; a different count here would
    make two instances lead the same keys under different shard numbers (and free each other's
    slots as orphans), so the caller refuses to start on a mismatch."""
    kv = await open_bucket(nc, CONFIG_BUCKET, None, replicas)

    async def agree() -> int:
        try:
            await kv.create("shards", str(shards).encode())
            return shards
        except nats.js.errors.KeyWrongLastSequenceError:
            entry = await kv.get("shards")
            return int((entry.value or b"0").decode())

    return await retrying(CONFIG_BUCKET, agree)


async def retrying(
    what: str,
    op: Callable[[], Awaitable[T]],
    *,
    timeout_s: float = BUCKET_OPEN_TIMEOUT_S,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`op()` again with a bounded backoff while it is refused or unanswered, until `timeout_s`:
    a bucket just made on a forming NATS cluster has no stream leader for a moment
    (`NoStreamResponseError`)."""
    deadline = clock() + timeout_s
    delay = BUCKET_RETRY_S
    attempt = 0
    while True:
        attempt += 1
        try:
            return await op()
        except (nats.js.errors.Error, nats.errors.Error, TimeoutError) as exc:
            if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError) or clock() + delay > deadline:
                raise
            _log.warning(
                "kv_bucket_open_retry",
                bucket=what,
                attempt=attempt,
                error=type(exc).__name__,
                description=getattr(exc, "description", None),
            )
            await asyncio.sleep(delay)
            delay = min(2 * delay, BUCKET_RETRY_S_MAX)

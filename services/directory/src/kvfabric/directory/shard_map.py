"""The shard map: which shards this directory instance leads, answered on a plain subscription.

`kvf.v1.directory.shard_map` (and per tenant `kvf.v1.directory.t.<tenant>.shard_map`) is not a
queue group: every instance answers with the shards it leads (`ShardHost.shard_map`), so a
router (`kvfabric.cluster.directory_router`) merges all answers into its map. A tenant's request
is answered only into its own inbox, only when it has a grant on this instance, and at most
`SHARD_MAP_TENANT_PER_S` times a second (burst as many): a tenant flooding it gets no answer (its
router retries later), counted in `rate_limited`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from kvfabric.core.quotas import TokenBucket
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.subjects import (
    TENANT_TOKEN,
    Service,
    endpoint_subject,
    service_group,
    tenant_from_subject,
    tenant_inbox_prefix,
)

__all__ = ["SHARD_MAP_TENANT_PER_S", "SHARD_MAP_VERB", "ShardMapServer"]

SHARD_MAP_VERB: Final = "shard_map"
# A router refreshes at most every 50 ms (20/s) while failing: 50/s per tenant leaves room for
# a few engines refreshing at once, and bounds what a flood costs this instance.
SHARD_MAP_TENANT_PER_S: Final = 50.0


class ShardMapServer:
    """Answers the shard map with `reply()`; `granted(tenant)`: the tenant has a grant here."""

    def __init__(self, reply: Callable[[], m.ShardMapReply], granted: Callable[[str], bool]) -> None:
        self._reply = reply
        self._granted = granted
        # One bucket per granted tenant that asked (bounded by the grants); refused answers.
        self._buckets: dict[str, TokenBucket] = {}
        self.rate_limited = 0

    async def subscribe(self, nc: NatsClient) -> list[object]:
        """Serve the service's and the tenants' subjects; returns the subscriptions."""

        async def answer(msg: Msg) -> None:
            if not msg.reply:
                return
            if msg.subject != endpoint_subject(Service.DIRECTORY, SHARD_MAP_VERB):
                try:  # a tenant's: answer only into its own inbox (see ServiceRuntime)
                    tenant = tenant_from_subject(msg.subject, Service.DIRECTORY)
                except ValueError:
                    return
                if not msg.reply.startswith(tenant_inbox_prefix(tenant) + "."):
                    return
                if not self.tenant_may_ask(tenant):
                    return
            try:
                await nc.publish(msg.reply, encode(self._reply()))
            except nats.errors.Error:
                return

        tenants = f"{service_group(Service.DIRECTORY)}.{TENANT_TOKEN}.*.{SHARD_MAP_VERB}"
        return [
            await nc.subscribe(endpoint_subject(Service.DIRECTORY, SHARD_MAP_VERB), cb=answer),
            await nc.subscribe(tenants, cb=answer),
        ]

    def tenant_may_ask(self, tenant: str) -> bool:
        if not self._granted(tenant):  # no share domains here: nothing to route, no bucket kept
            return False
        now_s = time.monotonic()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            rate = SHARD_MAP_TENANT_PER_S
            bucket = self._buckets[tenant] = TokenBucket.full(rate, rate, now_s)
        if bucket.take(1, now_s):
            return True
        self.rate_limited += 1
        return False

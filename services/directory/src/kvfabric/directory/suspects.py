"""Relaying a reader's corruption report to the segment that holds the bytes (issue 22).

A client that reads bytes whose hash does not match the object's checksum sends `ReplicaSuspect`
(verb `replica_suspect`, answered by any instance). Tenants may publish only to directory
subjects, and a report may be forged (by a buggy or hostile reader, or about another tenant's
object), so the directory does not drop anything on its word: it passes the slot to its segment
(`kvf.v1.segment.verify.<segment_id>`), which re-hashes it and, when it really is corrupt, frees
it and reports `replica_corrupt` like its scrubber (the replica is dropped from the index and
repair restores the target). A forged report costs one re-hash at the segment, nothing more.

Bounds: a tenant's report carries its share domains to the segment, which leaves a slot holding
an object of none of them alone (the reply is the same: nothing to learn); at most
`SUSPECTS_TENANT_PER_S` a second per tenant (token bucket, `allow`); at most
`RELAYS_INFLIGHT_MAX` relays in flight, each ending by itself within `RELAY_TIMEOUT_S` (the
host's stop cancels those left, `in_flight`); the reply never waits for the verdict (only
whether it was passed on).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

import nats.errors
from nats.aio.client import Client as NatsClient

from kvfabric.core import authz
from kvfabric.format.errors import BadRequest, KvfError
from kvfabric.format.ids import DomainDigest
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.segment import VerifyRequest
from kvfabric.proto.subjects import segment_subject
from kvfabric.runtime.logs import get_logger

__all__ = ["RELAYS_INFLIGHT_MAX", "RELAY_TIMEOUT_S", "SUSPECTS_TENANT_PER_S", "SUSPECT_VERB", "SuspectRelay"]

SUSPECT_VERB: Final = "replica_suspect"
SUSPECTS_TENANT_PER_S: Final = 20.0
RELAYS_INFLIGHT_MAX: Final = 64
RELAY_TIMEOUT_S: Final = 2.0


class SuspectRelay:
    """Owns the relays in flight; `nc_of` gives the instance's NATS connection once started."""

    def __init__(self, nc_of: Callable[[], NatsClient | None], allow: Callable[[str], bool]) -> None:
        self._nc_of = nc_of
        self._allow = allow  # tenant -> may it report now (its token bucket)
        self._relays: set[asyncio.Task[None]] = set()
        self.relayed = 0
        self.refused = 0
        self._log = get_logger("kvfabric.directory.suspects")

    async def handle(
        self, message: m.ReplicaSuspect, grant: authz.TenantGrant | None
    ) -> m.ReplicaSuspectReply:
        """Pass the report on (without waiting for the segment); `relayed` false when it was
        over a bound."""
        if grant is not None and not self._allow(grant.tenant):
            self.refused += 1
            return m.ReplicaSuspectReply(relayed=False)
        nc = self._nc_of()
        if nc is None or len(self._relays) >= RELAYS_INFLIGHT_MAX:
            self.refused += 1
            return m.ReplicaSuspectReply(relayed=False)
        try:
            subject = segment_subject(message.segment_id, "verify")
        except ValueError as exc:
            raise BadRequest(f"bad segment_id: {exc}") from None
        domains = sorted(grant.domains) if grant is not None else []
        task = asyncio.create_task(self._relay(nc, subject, message, domains))
        self._relays.add(task)
        task.add_done_callback(self._relays.discard)
        return m.ReplicaSuspectReply(relayed=True)

    async def _relay(
        self, nc: NatsClient, subject: str, message: m.ReplicaSuspect, domains: list[DomainDigest]
    ) -> None:
        request = VerifyRequest(
            incarnation=message.incarnation,
            slot=message.slot,
            slot_generation=message.slot_generation,
            domains=domains,
        )
        try:
            await nc.request(subject, encode(request), timeout=RELAY_TIMEOUT_S)
            self.relayed += 1
        except (nats.errors.Error, TimeoutError, KvfError) as exc:  # the scrubber still finds it
            self._log.info(
                "replica_suspect_not_relayed", segment_id=message.segment_id, error=type(exc).__name__
            )

    def in_flight(self) -> list[asyncio.Task[None]]:
        """The relays still running (the host's stop cancels and awaits them with its deadline)."""
        return list(self._relays)

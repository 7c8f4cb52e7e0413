"""A new leader's rebuild: ask every registered segment what it stores (paged `report`).

Each report request carries the new epoch, so from the moment a segment answers it refuses the
old leader's tickets and frees. A segment that does not answer in time, or whose incarnation
changed since it registered, is left out. A restarted one is then unknown to the new leader: its
next heartbeat is answered `not_found` and it restarts empty (what it held is lost, never served
stale). One that was only slow is introduced at its next heartbeat, and the shard rebuilt again
if it holds bytes (`kvfabric.directory.shard_host`).
"""

from __future__ import annotations

import asyncio
from typing import Final

from nats.aio.client import Client as NatsClient

from kvfabric.cluster.requests import request
from kvfabric.core.directory.rebuild import SegmentHolding
from kvfabric.format.errors import KvfError
from kvfabric.proto import directory as m
from kvfabric.proto.segment import (
    REPORT_PAGE_MAX,
    HeldObject,
    ReportRequest,
    SegmentMessage,
    SegmentReport,
    segment_decoder,
)
from kvfabric.proto.shards import shard_of
from kvfabric.proto.subjects import segment_subject
from kvfabric.runtime.logs import get_logger

__all__ = ["gather_holdings"]

REPORT_TIMEOUT_S: Final = 2.0
REPORT_ATTEMPTS_MAX: Final = 2
PAGES_MAX: Final = 100_000  # ≤ 409.6 M objects per segment: a bound, not a target
SEGMENTS_IN_PARALLEL_MAX: Final = 16

_log = get_logger("kvfabric.directory.rebuild")


def _of_shard(objects: list[HeldObject], shard: int, shards: int) -> list[HeldObject]:
    """The objects a leader of `shard` adopts (or frees as orphans). A key with no chain hash
    in it is an orphan of shard 0 only: no other shard's leader ever frees its slot."""
    if shards == 1:
        return objects
    out = []
    for held in objects:
        try:
            mine = shard_of(held.key, shards) == shard
        except ValueError:
            mine = shard == 0
        if mine:
            out.append(held)
    return out


async def _report(
    nc: NatsClient, reg: m.RegisterSegment, epoch: int, shard: int, shards: int
) -> SegmentHolding | None:
    objects: list[HeldObject] = []
    after = -1
    for _ in range(PAGES_MAX):
        reply: SegmentMessage | None = None
        for attempt in range(REPORT_ATTEMPTS_MAX):
            try:
                reply = await request(
                    nc,
                    segment_subject(reg.segment_id, "report"),
                    ReportRequest(epoch=epoch, after_slot=after, limit=REPORT_PAGE_MAX, shard=shard),
                    segment_decoder,
                    REPORT_TIMEOUT_S,
                )
                break
            except KvfError as exc:
                _log.info("segment_report_failed", segment_id=reg.segment_id, code=exc.code, attempt=attempt)
        if not isinstance(reply, SegmentReport):
            return None
        if reply.incarnation != reg.incarnation:
            _log.info("segment_restarted_since_registering", segment_id=reg.segment_id)
            return None
        objects.extend(_of_shard(reply.objects, shard, shards))
        if reply.next_after_slot < 0:
            return SegmentHolding(reg, objects)
        after = reply.next_after_slot
    return None


async def gather_holdings(
    nc: NatsClient, registrations: list[m.RegisterSegment], epoch: int, *, shard: int = 0, shards: int = 1
) -> list[SegmentHolding]:
    """Reports of every registered segment that answers (bounded parallelism), cut to the
    objects of `shard`. The report request carries (shard, epoch): the segment fences that
    shard's older leaders from then on."""
    limit = asyncio.Semaphore(SEGMENTS_IN_PARALLEL_MAX)

    async def one(reg: m.RegisterSegment) -> SegmentHolding | None:
        async with limit:
            return await _report(nc, reg, epoch, shard, shards)

    results = await asyncio.gather(*(one(r) for r in registrations))
    holdings = [h for h in results if h is not None]
    _log.info(
        "segments_reported",
        shard=shard,
        registered=len(registrations),
        answered=len(holdings),
        objects=sum(len(h.objects) for h in holdings),
    )
    return holdings

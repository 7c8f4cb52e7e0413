"""One more replica of a published object, copied segment to segment (repair, prefetch, drain).

`copy_replica` asks the directory for a ticket on the destination (`replicate_begin`, which
also names the live sources), then asks the destination segment to read the bytes from a source
over the data plane (`seg.copy`): the destination verifies them against the ticket's checksum and
confirms the replica, which joins the published record. No payload crosses NATS; the caller owns
nothing afterwards (a failed copy leaves nothing visible and the segment frees what it wrote).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final, Literal

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.cluster.requests import request
from kvfabric.dataplane.addresses import pick_stream
from kvfabric.format.errors import KvfError
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import CopyReply, CopyRequest, SegmentMessage, segment_decoder, tier_of_slot
from kvfabric.proto.subjects import segment_subject

__all__ = ["DISK_SOURCE_SUFFIX", "CopyOutcome", "copy_replica", "preferred_replica"]

# A disk replica named as a copy source: `<segment>#ssd` (never a segment id: [A-Za-z0-9_-])
DISK_SOURCE_SUFFIX: Final = "#ssd"

CopyOutcome = Literal["copied", "already_there", "not_found", "no_capacity", "segment_down", "failed"]


def preferred_replica(sources: list[m.Replica], preferred: str) -> m.Replica:
    """The source to copy from: `preferred` (a segment id: its arena replica, else its disk one;
    `<segment>#ssd`: its disk replica, else its arena one), else the first. A disk source the
    prefetch core chose was never matched (a name no segment id equals), and a plain id could
    match that segment's disk replica first (review, stop 70)."""
    segment, disk = preferred.removesuffix(DISK_SOURCE_SUFFIX), preferred.endswith(DISK_SOURCE_SUFFIX)
    on_segment = [r for r in sources if r.segment_id == segment]
    tier = "ssd" if disk else "dram"
    return next((r for r in on_segment if tier_of_slot(r.slot) == tier), (on_segment or sources)[0])


async def copy_replica(
    router: DirectoryRouter,
    *,
    key: ObjectKey,
    destination: str,
    writer_id: str,
    request_id: str,
    timeout_s: float,
    preferred_source: str = "",
) -> CopyOutcome:
    """Copy `key`'s object onto `destination`. Raises KvfError when a request fails (timeout,
    segment refused the copy); returns the directory's verdict otherwise."""
    nc = router.nc
    shard = router.shard_of(key)
    copied: SegmentMessage | None = None
    placed = True  # until the directory says it placed nothing: a cancelled or timed-out
    # replicate_begin may have been granted (its ticket would hold a reservation until its deadline)
    try:
        reply = await router.ask(
            shard,
            "replicate_begin",
            m.ReplicateBegin(
                writer_id=writer_id,
                request_id=request_id,
                key=key,
                segment_id=destination,
                write_ttl_ms=max(1, int(timeout_s * 1000)),
            ),
            timeout_s,
        )
        if not isinstance(reply, m.ReplicateBeginReply):
            return "failed"
        if reply.status != "placed":
            placed = False
            return reply.status
        if reply.ticket is None or not reply.sources:
            return "failed"
        source = preferred_replica(reply.sources, preferred_source)
        copied = await request(
            nc,
            segment_subject(destination, "copy"),
            CopyRequest(
                ticket=reply.ticket,
                source_addr=pick_stream(source.data_addr),
                source_incarnation=source.incarnation,
                source_slot=source.slot,
                source_slot_generation=source.slot_generation,
                source_read_token=source.read_token,
                source_read_expires_ms=source.read_expires_ms,
            ),
            segment_decoder,
            timeout_s,
        )
    finally:
        if placed and not isinstance(copied, CopyReply):  # failed, timed out or cancelled
            await _abort_to_the_end(router, key, writer_id, request_id, timeout_s)
    return "copied"


async def _abort_to_the_end(
    router: DirectoryRouter, key: ObjectKey, writer_id: str, request_id: str, timeout_s: float
) -> None:
    """`_abort`, awaited until it is answered (bounded by `timeout_s`) even when the copy is
    cancelled meanwhile, then the cancel passes on. Aborts are by key and writer: one left to
    run on its own after its copy ended landed after the caller's next copy of the key began,
    and aborted that copy's ticket (review, 2026-12-06)."""
    abort = asyncio.ensure_future(_abort(router, key, writer_id, request_id, timeout_s))
    cancelled = False
    while not abort.done():
        try:
            await asyncio.shield(abort)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def _abort(
    router: DirectoryRouter, key: ObjectKey, writer_id: str, request_id: str, timeout_s: float
) -> None:
    """Give the destination's reservation back at once (else it lasts until the ticket's deadline).
    Best effort: if the copy did land after all, its confirm already made it a replica."""
    with contextlib.suppress(KvfError):
        await router.ask(
            router.shard_of(key),
            "put_abort",
            m.PutAbort(writer_id=writer_id, request_id=f"{request_id}-abort", keys=[key]),
            timeout_s,
        )

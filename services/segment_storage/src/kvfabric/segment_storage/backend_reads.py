"""The segment backend's reads: transfer references (GET grants and local pins) of arena slots,
disk replicas read (or streamed) into private buffers, and their release. A mixin over
`BackendCore`; who owns a reference is told in `kvfabric.segment_storage.backend`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from kvfabric.dataplane.backend import GetGrant
from kvfabric.format.errors import BadRequest, Busy, KvfError, StaleGeneration
from kvfabric.proto.dataplane import LocalGrant, LocalGrants, MapReply, ObjectResult, ObjectStatus, ReadRef
from kvfabric.proto.segment import SSD_SLOT_BASE
from kvfabric.segment_storage.backend_core import BackendCore
from kvfabric.segment_storage.ssd import SsdRead, SsdStream, release_reads

__all__ = [
    "DISK_SHARE_WAIT_S",
    "LOCAL_GRANTS_PER_CONNECTION_MAX",
    "PIN_HOLD_MS_MAX",
    "PIN_HOLD_MS_MIN",
    "BackendReads",
]

# Transfer-reference grants (GET in progress, PIN_LOCAL not yet unpinned) one connection may hold:
# a client holds one or two (a pin, and the pipelined unpin of the previous one).
LOCAL_GRANTS_PER_CONNECTION_MAX: Final = 64
# A local pin lapses when its read tokens do (plus the clock skew tolerance), or this long after
# it was taken when the segment needs no tokens: a pin held past its lease kept the object's
# arena bytes after the directory freed it, and a tenant pinning, releasing and evicting in a
# loop held memory nobody accounted for (review, 2026-12-06). The shell calls `expire_pins`.
PIN_HOLD_MS_MAX: Final = 60_000
# ... but never sooner than this after it was taken, whatever its tokens say: the pin is the
# local reference the copy it protects (a memcpy of at most one object) holds, and a timeout
# never lets memory be reused while a transfer runs (DESIGN invariant 3). A token a few seconds
# from expiry would otherwise have let the pin lapse during the copy.
PIN_HOLD_MS_MIN: Final = 10_000
# A streamed GET's disk objects wait at most this long in all (from its `_read_disk`) for their
# tenant's pieces of the disk I/O queue to drain below its share (`SsdIo`, `IO_TENANT_SHARE_DIVISOR`)
# before the GET is `busy`: its own earlier objects' pieces end in a disk read's time each. On the
# connection's thread, well inside the frame timeout that bounds `begin_get_streamed` over TCP
# (10 s by default); a GET not streamed waits for nothing (its objects are read one after another,
# each one's pieces ended before the next, and over UCX on the event loop). Fixed, not the frame
# timeout's rest: it stays well under the client's budget for one replica's attempt
# (`replica_attempt_share_pct` of `load_timeout_ms`, 5 s by default), after which the client has
# shut the socket and tries another replica; a wait past that held the tenant's read bytes and
# slot references for a reader gone (review, 2026-12-07).
DISK_SHARE_WAIT_S: Final = 2.0


class BackendReads(BackendCore):
    """GETs and local pins (`ArenaBackend`)."""

    def _refusal(self, ref: ReadRef) -> ObjectStatus | None:
        """Not under the lock (pure: its incarnation, its token's expiry and MAC): why `ref` may
        not be read, or None."""
        if ref.incarnation != self.incarnation:
            return "stale_incarnation"
        if self.read_tokens_required and not self._token_ok(ref):
            return "unauthorized"
        return None

    def _acquire(self, ref: ReadRef) -> tuple[ObjectStatus, int, bytes]:
        """Under the lock: take a transfer reference of a ref its checks passed. Returns
        (status, offset, checksum)."""
        try:
            grant = self.slots.acquire(ref.slot, ref.slot_generation, ref.size_bytes)
        except StaleGeneration:
            return "stale_generation", 0, b""
        except BadRequest:
            return "wrong_size", 0, b""
        except KvfError:
            return "not_found", 0, b""
        return "ok", grant.offset, grant.checksum

    def _pin(
        self,
        reads: list[ReadRef],
        conn: int,
        skip: frozenset[int] = frozenset(),
        absent: frozenset[int] = frozenset(),
    ) -> tuple[int, list[tuple[ObjectStatus, int, bytes]]]:
        """Take a transfer reference per readable ref (but those at the indexes in `skip`: disk
        replicas a GET reads, checked and answered by the caller), held as one grant of the
        connection; a slot named twice is taken once (its result repeated). A ref at an index
        in `absent` (a disk replica a PIN_LOCAL names: not in the mapped arena) is checked like
        the others and answered `not_found` only when it passes: answered `not_found` unchecked,
        a forged token on a disk slot read as accepted, and its PIN_LOCAL renewed the
        connection's idle deadline for good (review, stop 71). A grant that holds nothing
        (every ref refused: no token, stale, missing) is not kept, so a flood of refused pins
        leaves no state; a connection holds at most `LOCAL_GRANTS_PER_CONNECTION_MAX` grants
        (more is `Busy`: unpin first). The tokens' MACs are checked before the lock: under it,
        one request of `READS_MAX` refs held every other tenant's transfers up ~17 ms, and
        named one slot 4,096 times (review, stop 67)."""
        refused = [None if i in skip else self._refusal(ref) for i, ref in enumerate(reads)]
        with self.lock:
            held = self._conns.get(conn)
            if held is not None and len(held.grants) >= LOCAL_GRANTS_PER_CONNECTION_MAX:
                self._count("grants_busy_total")
                raise Busy(
                    "too many pinned grants on this connection: unpin first",
                    limit=LOCAL_GRANTS_PER_CONNECTION_MAX,
                )
            acquired: list[tuple[ObjectStatus, int, bytes]] = []
            taken: dict[tuple[int, int, int], tuple[ObjectStatus, int, bytes]] = {}  # (slot, gen, size)
            for i, (ref, why) in enumerate(zip(reads, refused, strict=True)):
                if i in skip:
                    acquired.append(("not_found", 0, b""))  # (the caller's answer replaces it)
                elif why is not None:
                    self._count(
                        "stale_incarnation_read_total"
                        if why == "stale_incarnation"
                        else "read_token_rejected_total"
                    )
                    acquired.append((why, 0, b""))
                elif i in absent:
                    acquired.append(("not_found", 0, b""))  # its token passed: not in the arena
                else:
                    key = (ref.slot, ref.slot_generation, ref.size_bytes)
                    if key not in taken:
                        taken[key] = self._acquire(ref)
                    acquired.append(taken[key])
            refs = [(slot, generation) for (slot, generation, _), a in taken.items() if a[0] == "ok"]
            grant_id = next(self._grant_ids)
            if refs:
                self._conn(conn).grants[grant_id] = refs
        return grant_id, acquired

    def _unpin(self, grant_id: int, conn: int) -> int:
        with self.lock:
            c = self._conns.get(conn)
            refs = c.grants.pop(grant_id, []) if c is not None else []
            for slot, generation in refs:
                self.slots.release(slot, generation)
            return len(refs)

    def begin_get(self, reads: list[ReadRef], conn: int) -> GetGrant:
        return self._begin_get(reads, conn, stream=False)

    def begin_get_streamed(self, reads: list[ReadRef], conn: int) -> GetGrant:
        """`begin_get` for a client that takes verdicts after the bytes: a disk replica's read is
        started, not finished — the transport sends each piece as it lands (`GetGrant.filling`)
        while the rest is read, so reading the disk and sending overlap; then `verdicts()`: a
        replica whose bytes failed their checksum (or the device) is freed and reported as with
        `begin_get`, and answered `stale_generation` after its bytes (the client drops them)."""
        return self._begin_get(reads, conn, stream=True)

    def _begin_get(self, reads: list[ReadRef], conn: int, *, stream: bool) -> GetGrant:
        disk = [i for i, ref in enumerate(reads) if ref.slot >= SSD_SLOT_BASE] if self.ssd is not None else []
        disk_reads = self._read_disk([reads[i] for i in disk], stream) if disk else []
        try:
            grant_id, acquired = self._pin(reads, conn, frozenset(disk))  # disk refs: replaced below
        except BaseException:
            release_reads([done for _, done in disk_reads if done is not None])
            raise
        views: list[memoryview | None] = [
            self.arena.slice(offset, ref.size_bytes).toreadonly() if status == "ok" else None
            for ref, (status, offset, _) in zip(reads, acquired, strict=True)
        ]
        statuses = [a[0] for a in acquired]
        checksums = [a[2] for a in acquired]
        for i, (status, read) in zip(disk, disk_reads, strict=True):
            statuses[i], checksums[i] = status, read.checksum if read is not None else b""
            views[i] = read.view.toreadonly() if read is not None and read.view is not None else None
        held = [read for _, read in disk_reads if read is not None]
        with self.lock:
            c = self._conn(conn)
            if held:
                c.disk_reads[grant_id] = held
            c.gets.add(grant_id)
            self._gets_served += 1
        streams = {
            i: read for i, (_, read) in zip(disk, disk_reads, strict=True) if isinstance(read, SsdStream)
        }
        if not streams:
            return GetGrant(grant_id, statuses, checksums, views)
        filling: list[Callable[[int], int] | None] = [None] * len(reads)
        for i, read in streams.items():
            filling[i] = read.wait
        first = [ObjectResult(s, c) for s, c in zip(statuses, checksums, strict=True)]

        def verdicts() -> list[ObjectResult]:
            out = list(first)
            for i, read in streams.items():
                if not read.verdict():  # freed by the tier: reported like a corrupt replica
                    ref = reads[i]
                    if self.report_corrupt is not None:
                        self.report_corrupt(read.key, ref.slot, read.generation, ref.size_bytes)
                    self.count("disk_get_failed_after_bytes_total")
                    out[i] = ObjectResult("stale_generation", b"")
            return out

        return GetGrant(grant_id, statuses, checksums, views, filling, verdicts)

    def _read_disk(
        self, reads: list[ReadRef], stream: bool = False
    ) -> list[tuple[ObjectStatus, SsdRead | SsdStream | None]]:
        """Read disk replicas into private buffers (blocks on the disk), or with `stream` start
        reading them (`SsdTier.read_stream`: checked after the bytes). A replica found corrupt
        (or unreadable) is freed by the tier and reported; the reader sees `stale_generation`
        (its generation moved on). `Busy` (I/O bounds) gives back whatever was read already.
        Streamed, every object but the first is queued at once: past its tenant's share of the
        I/O queue's pieces, the next one waits (until `DISK_SHARE_WAIT_S` after the GET began) for
        the GET's earlier ones to be read, rather than fail the GET (a GET of 193 one-piece disk
        objects was `busy` alone against its own pieces with the share, or with no share took
        every slot of the queue, every other tenant's reads and the demotions `busy`). Past its
        tenant's share of the read bytes (`SsdTier.read_bytes_max`) it is `busy` at once, its own
        earlier objects' bytes included: they are held until the transport has sent them
        (`end_get`, on this same thread), so no wait here could see them go back. `Busy` gives
        the earlier objects back together (`release_reads`): their pieces not started are
        cancelled, all of them, before it waits for the running ones."""
        assert self.ssd is not None
        out: list[tuple[ObjectStatus, SsdRead | SsdStream | None]] = []
        share_wait_until = time.monotonic() + DISK_SHARE_WAIT_S if stream else 0.0
        try:
            for ref in reads:
                if ref.incarnation != self.incarnation:
                    self.count("stale_incarnation_read_total")
                    out.append(("stale_incarnation", None))
                    continue
                if self.read_tokens_required and not self._token_ok(ref):
                    self.count("read_token_rejected_total")
                    out.append(("unauthorized", None))
                    continue
                if stream:  # the first disk object read now, later ones while it is sent
                    first = not any(done is not None for _, done in out)
                    read: SsdRead | SsdStream = self.ssd.read_stream(
                        ref.slot,
                        ref.slot_generation,
                        ref.size_bytes,
                        inline_first=first,
                        alone=len(reads) == 1,
                        share_wait_until=share_wait_until,
                    )
                else:
                    read = self.ssd.read(ref.slot, ref.slot_generation, ref.size_bytes)
                if read.status == "ok":
                    out.append(("ok", read))
                    continue
                if read.status == "corrupt":
                    if self.report_corrupt is not None:
                        self.report_corrupt(read.key, ref.slot, read.generation, ref.size_bytes)
                    out.append(("stale_generation", None))
                else:
                    out.append((read.status, None))
        except BaseException:
            release_reads([done for _, done in out if done is not None])
            raise
        return out

    def end_get(self, grant: GetGrant, conn: int) -> None:
        for view in grant.views:
            if view is not None:
                view.release()
        self._unpin(grant.grant_id, conn)
        with self.lock:
            c = self._conns.get(conn)
            buffers = c.disk_reads.pop(grant.grant_id, []) if c is not None else []
            if c is not None and grant.grant_id in c.gets:
                c.gets.discard(grant.grant_id)
                self._gets_ended(1)
        release_reads(buffers)  # (a GET cut short: its later objects' pieces not started too)

    def map_info(self) -> MapReply:
        return MapReply(
            arena_path=str(self.arena.path),
            arena_bytes=self.arena.size_bytes,
            incarnation=self.incarnation,
            board_path=str(self.arena.board.path),
        )

    def pin_local(self, reads: list[ReadRef], conn: int) -> LocalGrants:
        # a disk replica is not in the mapped arena: `not_found` once its checks pass (else its
        # refusal: the transport renews the idle deadline by the statuses), without the slot
        # table's count
        disk = frozenset(i for i, ref in enumerate(reads) if ref.slot >= SSD_SLOT_BASE)
        grant_id, acquired = self._pin(reads, conn, absent=disk)
        now = self.clock_ms()
        held = [ref for ref, a in zip(reads, acquired, strict=True) if a[0] == "ok"]
        if held:
            if self.read_tokens_required:
                lapses = max(ref.expires_ms for ref in held) + self.clock_skew_tolerance_ms
                lapses = min(max(lapses, now + PIN_HOLD_MS_MIN), now + PIN_HOLD_MS_MAX)
            else:
                lapses = now + PIN_HOLD_MS_MAX
            with self.lock:
                c = self._conns.get(conn)
                if c is not None and grant_id in c.grants:
                    c.pin_expiry_ms[grant_id] = lapses
        return LocalGrants(grant_id=grant_id, grants=[LocalGrant(s, o, c) for s, o, c in acquired])

    def unpin_local(self, grant_id: int, conn: int) -> int:
        with self.lock:
            c = self._conns.get(conn)
            if c is not None:
                c.pin_expiry_ms.pop(grant_id, None)
        return self._unpin(grant_id, conn)

    def expire_pins(self) -> int:
        """Release every local pin past its lapse time (`PIN_HOLD_MS_MAX`); how many. O(pins):
        at most `LOCAL_GRANTS_PER_CONNECTION_MAX` a connection."""
        now = self.clock_ms()
        expired = 0
        with self.lock:
            for c in self._conns.values():
                for grant_id in [g for g, lapses in c.pin_expiry_ms.items() if lapses <= now]:
                    del c.pin_expiry_ms[grant_id]
                    for slot, generation in c.grants.pop(grant_id, []):
                        self.slots.release(slot, generation)
                    expired += 1
        if expired:
            self.count("local_pins_expired_total", expired)
        return expired

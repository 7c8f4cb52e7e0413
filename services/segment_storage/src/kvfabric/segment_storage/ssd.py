"""The segment's disk tier: one preallocated file, a bounded I/O engine, crash-consistent commits.

The file is `<KVF_SEGMENT_SSD_PATH>/kvf-<segment id>.ssd`: header | index | data
(`kvfabric.core.disk_records`), created at the configured size with `posix_fallocate` (so a
full disk shows at start, never in the middle of a write) and mode 0600. Unlike the arena it
outlives the process: a restarted segment (new incarnation) recovers what its index names.

Who decides what: the pure `DiskSlotTable` (`kvfabric.core.disk_slots`) owns slots, extents,
generations and the order of durable steps; this shell does the I/O it asks for, under one lock
for the table (never held during I/O).

Write protocol (`write`), each step in order, each sync a real `fdatasync` of the file:
1. `alloc` an extent and slot; 2. write the bytes (the I/O engine, in pieces); 3. sync;
4. `begin_commit` -> the commit record; 5. write it (one 512-byte sector); 6. sync;
7. `end_commit` -> readable. A free (`free_many`) writes free records, syncs once for all of
them, then `unlinked` each: only then may the extent and slot be reused, and only then is the free
acknowledged (returned to the directory, which stops asking). One whose record's write or sync
failed is not: its slot stays held, `retry_unlinks` writes the record again, and the directory's
next free of it is acknowledged once that landed — until then a restart recovers the object from
its commit record. A record that fails does not stop the others of its batch: they are written,
synced and `unlinked` (one bad index sector failed every retry batch it led). A free whose own
record has failed for `UNLINK_GIVE_UP_S` (a bad sector), or any free once a sync failed, is
acknowledged though not durable (counted `frees_acknowledged_undurable_total`): held, each group
with a disk replica here stayed `evicting` at the directory for good; a restart then recovers
them as after a crash. A crash between any two
steps leaves an index from which `recover` returns exactly the objects whose bytes and commit
record were complete (tests/unit/segment_storage/test_ssd_crash.py tears and drops writes at
every step; tests/unit/core/test_disk_slots_machine.py checks the protocol against a model).
Concurrent syncs are shared (`GroupSync`: a sync started after your write covers you).

Reads (`read`) take a read reference on the slot (a free meanwhile is deferred), read the extent
into a buffer from the tier's `ReadBufferPool`, release, then hash the bytes: a mismatch (or an
I/O error) frees the slot at once — its generation moves on, so no later read names it — and is
returned as `corrupt`, for the shell to report like a scrubbed replica.

Read buffers: page-aligned, pre-faulted, reused (mapping and faulting a fresh buffer per read
cost about as much as the disk read itself: docs/ssd-tier.md "Figures"). Who holds one: the pool
lends it to `read`; an `ok` read hands it to its caller inside the `SsdRead`, whose `release`
gives it back (the backend calls it in `end_get` or when the connection closes, i.e. after the
transport has sent it — a view of it must not outlive `release`, the next read reuses the
memory); every other outcome (corrupt, an I/O error, `Busy`, any exception) gives it back before
`read` returns. Several streams given back at once (`release_reads`: a GET ended or refused, a
connection closed) have every one's pieces not yet started cancelled first, then wait for the
running ones: released one after another, each waited for its own running pieces while the
threads started the later streams' queued ones, and a GET of 250 one-piece objects refused `busy`
after 39 s instead of 2 (review, 2026-12-07). The pool holds at most `read_bytes_max` bytes of
buffers, lent and idle together (idle ones of other sizes are unmapped to make room); a buffer is
never lent twice.

Write bounce buffers: an `O_DIRECT` write whose source is not block-aligned (a demotion copies
from a 64-byte-aligned arena slot) goes through a buffer from a second pool (`write_buffers`,
`WRITE_BOUNCE_BYTES_MAX`), its tail past the object zeroed (no bytes of an earlier object reach
the disk), given back when the write returns.

Bounds: the I/O engine runs at most `io_threads` pieces at once and holds at most
`io_queue_max` pieces queued or running; a request that would exceed it is `Busy` at once (one
request always may when none is in flight: an object of more pieces), and one tenant's reads
hold at most three quarters of those pieces (`IO_TENANT_SHARE_DIVISOR`), the last quarter always
the others' and the segment's own; a streamed read may wait, bounded, for its tenant's pieces to
drain below that (`read_stream`'s `share_wait_until`: a streamed GET's, 2 s from its start,
`DISK_SHARE_WAIT_S` in `backend_reads`). Reads hold at most `read_bytes_max` bytes of buffers, one tenant's
three quarters of them; past it, `Busy` at once, never waited for (a streamed GET's earlier
objects hold their bytes until they are sent, after the GET began). A device
that never answers an I/O holds the thread that issued it (a syscall cannot be cancelled); the
bounds then turn the rest away. A failed `fdatasync` (the kernel may have dropped the dirty
pages) stops the tier for writes until restart (`Unavailable`, reason `ssd_failed`): what it
committed before stays readable, and frees are acknowledged though their records cannot be made durable (the
restarted segment reports what it recovered, as after a crash, and the directory adopts or
frees it).

Modules: this one holds the tier (file, index, write/free/read protocol); the buffers and their pool
are `ssd_buffers`, the I/O engine and shared sync `ssd_io`, the read results (`SsdRead`, the
streamed `SsdStream`) `ssd_reads`; all are re-exported here. `SsdTier` stays one class: its write,
free and read protocols share one lock, one slot table and one file.

Not split (over 600 lines): what is left here is `SsdTier` alone, and each of its protocols
(create/recover, write, free, read) takes and releases slots of the one `DiskSlotTable` under
the one lock, around I/O on the one file; split into mixins, every part would reach into the
others' state (the lock, the table, the in-flight read bytes, the counters) and the order of
durable steps, which this module's docstring tells in one place, would be spread over several.

Slot ids on the wire: local slot i is `SSD_SLOT_BASE + i` (`kvfabric.proto.segment`), so frees,
reads, read tokens, reports and corruption reports name disk replicas exactly as DRAM ones.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Final

import numpy as np

from kvfabric.core.disk_records import (
    BLOCK_BYTES,
    RECORD_BYTES,
    DiskHeader,
    HeaderError,
    Record,
    decode_header,
    decode_record,
    encode_header,
    encode_record,
    geometry,
)
from kvfabric.core.disk_slots import DiskAlloc, DiskGrant, DiskHeld, DiskSlotTable
from kvfabric.core.quotas import tenant_of
from kvfabric.dataplane.frames import OBJECT_BYTES_MAX
from kvfabric.format.checksum import checksum
from kvfabric.format.clock import now_ms
from kvfabric.format.errors import (
    BadRequest,
    Busy,
    KvfError,
    NotFound,
    StaleGeneration,
    Unavailable,
)
from kvfabric.proto.segment import SSD_SLOT_BASE
from kvfabric.segment_storage.ssd_buffers import ReadBufferPool, aligned_buffer, prefaulted_buffer
from kvfabric.segment_storage.ssd_io import (
    IO_TENANT_SHARE_DIVISOR,
    STREAM_HEAD_DIVISOR_DEFAULT,
    GroupSync,
    SsdIo,
    stream_head_bytes,
)
from kvfabric.segment_storage.ssd_reads import ReadStatus, SsdRead, SsdStream, release_reads

__all__ = [
    "IO_TENANT_SHARE_DIVISOR",
    "READ_TENANT_SHARE_DIVISOR",
    "SSD_FILE_MODE",
    "GroupSync",
    "ReadBufferPool",
    "SsdFileRefused",
    "SsdIo",
    "SsdRead",
    "SsdStream",
    "SsdTier",
    "aligned_buffer",
    "prefaulted_buffer",
    "release_reads",
    "ssd_file_path",
]

SSD_FILE_MODE: Final = 0o600
# Upper bounds (seconds) of the I/O latency histogram's buckets (`io_latency`), +Inf implied.
IO_SECONDS_BUCKETS: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
INDEX_READ_BYTES: Final = 4 << 20  # the index is read at start in pieces of this size
# Pooled O_DIRECT bounce buffers of writes, lent and idle together (8 demotions of 4 MiB at once
# fit twice); past it a write's buffer is made for it and unmapped after (`ReadBufferPool`).
WRITE_BOUNCE_BYTES_MAX: Final = 64 << 20
# One tenant's disk reads in flight leave this share of `read_bytes_max` to the others (by the
# key's share domain; one read of a tenant holding none always may, within the whole budget).
READ_TENANT_SHARE_DIVISOR: Final = 4
# A free whose own record has failed this long (`retry_unlinks` writes it again every second: a bad
# index sector) is acknowledged to the directory though not durable (`free_many`). Per record, from
# its first failure: a count of failed writes shared by the tier was reset by any unrelated free
# that landed (a bad sector's free was never acknowledged) and reached by a burst of concurrent
# failing batches within a second (frees acknowledged whose next retry would have landed).
UNLINK_GIVE_UP_S: Final = 30.0
_SEGMENTS_OWN: Final = b"\x00segment"  # the tenant the segment's own reads are counted for


class SsdFileRefused(RuntimeError):
    """The disk tier file exists but is not this segment's as configured, or is damaged or
    truncated: it is never served. The message says what differs and what to do."""


def ssd_file_path(directory: Path, segment_id: str) -> Path:
    return directory / f"kvf-{segment_id}.ssd"


class SsdTier:
    """One segment's disk tier. Thread-safe; every method may block on I/O (call from a thread)."""

    def __init__(
        self,
        directory: Path,
        segment_id: str,
        data_bytes: int,
        slots_max: int,
        *,
        direct: bool,
        io: SsdIo,
        read_bytes_max: int,
        verify_on_start: bool = False,
        sync: Callable[[int], None] = os.fdatasync,
        stream_head_divisor: int = STREAM_HEAD_DIVISOR_DEFAULT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = ssd_file_path(directory, segment_id)
        self.segment_id = segment_id
        self.direct = direct
        self.io = io
        self.stream_head_divisor = stream_head_divisor  # a GET's only disk object: its head, 1/N
        self.read_bytes_max = read_bytes_max
        self.read_buffers = ReadBufferPool(read_bytes_max)
        # O_DIRECT bounce buffers of writes whose source is not block-aligned (a demotion's arena
        # slot): pooled like the read buffers (a fresh mapping faulted in per write cost about as
        # much as the write of a 4 MiB object: docs/ssd-tier.md)
        self.write_buffers = ReadBufferPool(WRITE_BOUNCE_BYTES_MAX)
        # O_DIRECT commit and free records: one aligned sector per writing thread, kept (4 KiB each)
        self._record_buffers = threading.local()
        self.geometry = geometry(slots_max, data_bytes)
        self.lock = threading.Lock()
        self.counters: dict[str, int] = {}
        self.read_bytes_in_flight = 0
        self._read_bytes_by_tenant: dict[bytes, int] = {}  # of `read_bytes_in_flight`, per key's tenant
        self.unlinks_pending = False  # a free record's write failed: `retry_unlinks` has work
        self._clock = clock  # seconds, monotonic: when a free record first failed (`UNLINK_GIVE_UP_S`)
        # local slot -> (its free record's generation, when that record's write or sync first
        # failed): an entry per slot whose free record is not durable after a failure (bounded by
        # `slots_max`), dropped when the record lands (`unlinked`; the slot is reused only after)
        self._unlink_failing: dict[int, tuple[int, float]] = {}
        # op -> (count per bucket of IO_SECONDS_BUCKETS + one for +Inf, sum of seconds)
        self._latency: dict[str, tuple[list[int], list[float]]] = {
            op: ([0] * (len(IO_SECONDS_BUCKETS) + 1), [0.0]) for op in ("write", "read")
        }
        self.created = False
        self.stale_removed: list[Path] = []
        directory.mkdir(parents=True, exist_ok=True)
        self._fd = -1
        self._direct_fd = -1
        try:
            self._open()
            self._sync = GroupSync(self._fd, sync)
            try:
                # No object larger than the data plane carries is ever written here (PUTs, copies
                # and demotions all come through it): a record naming more is dropped. A crafted
                # size, up to the data region, was read (at start with verify on, or by a GET)
                # into one pre-faulted buffer of that size; a mapping that failed escaped the
                # start as `Busy` (stop 70's list)
                self.table, unlinks = DiskSlotTable.recover(
                    data_bytes, self._read_index(), size_max=OBJECT_BYTES_MAX
                )
                if unlinks:  # dropped commit records: superseded on disk before anything is allocated
                    for record in unlinks:
                        self._write_record(record)
                    self._sync.sync()
                    for record in unlinks:
                        self.table.unlinked(record.slot, record.generation)
            except (OSError, Unavailable) as exc:  # a bad sector, a failing disk (a failed sync
                # is `Unavailable`: it escaped as a traceback, review, stop 68): said, exit 2
                raise SsdFileRefused(
                    f"{self.path}: its index could not be read or recovered ({exc}): check the disk, "
                    "or remove the file to start empty"
                ) from exc
            except Exception as exc:  # the last line: whatever else a record (its digest valid:
                # the file id is in the header) makes recovery raise, an invariant too, is said and
                # exit 2, never a traceback and a restart into the same (stop 70's list)
                raise SsdFileRefused(
                    f"{self.path}: its index could not be recovered ({exc!r}): a damaged or crafted "
                    "index record; move the file away or remove it to start empty"
                ) from exc
            if verify_on_start:
                self._verify_all()
        except BaseException:
            self.close()
            raise
        self.recovered_objects = self.table.objects
        self.recovered_bytes = self.table.stored_bytes

    # ---- the file ------------------------------------------------------------------------------

    def _open(self) -> None:
        """Open the file, or make it: under a temporary name (`.new`), preallocated, its header
        written and synced, then renamed into place — so a start killed half-way leaves no file
        the next start would refuse, only a `.new` it removes."""
        if self.path.exists():
            self._fd = os.open(self.path, os.O_RDWR)
            self._lock()
            self.header = self._check_header()
        else:
            self._create()
        if self.direct:
            self._direct_fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            self._probe_record_alignment()

    def _probe_record_alignment(self) -> None:
        """One record-sized direct read of the index: a device whose direct I/O needs more than
        `RECORD_BYTES` alignment (a drive with 4 KiB logical sectors) refuses every record write
        with EINVAL — each commit would then fail, and its free record too, until the tier held
        all its space. Refused here, at start, with what to do (review, 2026-12-05)."""
        buf = prefaulted_buffer(RECORD_BYTES)
        view = memoryview(buf)
        record = view[:RECORD_BYTES]  # one record's length: what a record write is
        refused = False
        try:
            os.preadv(self._direct_fd, [record], self.geometry.index_offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            refused = True
        finally:
            record.release()
            view.release()
            buf.close()
        if refused:
            raise SsdFileRefused(
                f"{self.path}: the device refuses {RECORD_BYTES}-byte direct I/O (4 KiB logical "
                "sectors?): set KVF_SEGMENT_SSD_DIRECT=0 for this disk tier"
            )

    def _lock(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SsdFileRefused(f"{self.path} is in use by another process") from None

    def _create(self) -> None:
        g = self.geometry
        new = self.path.with_name(self.path.name + ".new")
        new.unlink(missing_ok=True)  # a start killed while creating (the segment id's lock is ours)
        self._fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, SSD_FILE_MODE)
        try:
            self._lock()
            try:
                os.posix_fallocate(self._fd, 0, g.file_bytes)  # the space is ours now, or this fails
            except OSError as exc:
                raise SsdFileRefused(
                    f"cannot take {g.file_bytes} bytes for the disk tier at {self.path}: {exc.strerror}; "
                    "free space there or lower KVF_SEGMENT_SSD_BYTES"
                ) from None
            header = DiskHeader(g, secrets.token_bytes(16), self.segment_id, now_ms())
            os.pwrite(self._fd, encode_header(header), 0)
            os.fsync(self._fd)
            os.rename(new, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the file's name is durable too
            finally:
                os.close(dir_fd)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            new.unlink(missing_ok=True)
            raise
        self.header = header
        self.created = True

    def _check_header(self) -> DiskHeader:
        g = self.geometry
        size = os.fstat(self._fd).st_size
        try:
            header = decode_header(os.pread(self._fd, 4096, 0))
        except HeaderError as exc:
            raise SsdFileRefused(
                f"{self.path} is not a usable disk tier file: {exc}; move it away or remove it to start empty"
            ) from None
        wrong = []
        if header.segment_id != self.segment_id:
            wrong.append(f"segment {header.segment_id!r}, this is {self.segment_id!r}")
        if header.geometry != g:
            wrong.append(
                f"{header.geometry.data_bytes} data bytes and {header.geometry.slots_max} slots, configured "
                f"{g.data_bytes} and {g.slots_max} (KVF_SEGMENT_SSD_BYTES / KVF_SEGMENT_SSD_SLOTS_MAX)"
            )
        if size < header.geometry.file_bytes:
            wrong.append(f"truncated: {size} bytes of {header.geometry.file_bytes}")
        if wrong:
            raise SsdFileRefused(
                f"{self.path} was made for another configuration ({'; '.join(wrong)}): start with the same "
                "settings, or remove the file to start empty"
            )
        return header

    def _read_index(self) -> list[Record | None]:
        g = self.geometry
        records: list[Record | None] = []
        total = g.slots_max * RECORD_BYTES
        for start in range(0, total, INDEX_READ_BYTES):
            chunk = os.pread(self._fd, min(INDEX_READ_BYTES, total - start), g.index_offset + start)
            view = memoryview(chunk)
            for i in range(0, len(chunk), RECORD_BYTES):
                slot = (start + i) // RECORD_BYTES
                records.append(decode_record(view[i : i + RECORD_BYTES], self.header.file_id, slot))
        return records

    def _verify_all(self) -> None:
        """Re-hash every recovered object; a mismatch is freed now (start-up, before serving)."""
        for held in self.table.held():
            result = self.read(SSD_SLOT_BASE + held.slot, held.generation, held.size)
            result.release()

    @property
    def data_fd(self) -> int:
        return self._direct_fd if self.direct else self._fd

    def close(self) -> None:
        self.read_buffers.close()
        self.write_buffers.close()
        for fd in (self._direct_fd, self._fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._direct_fd = -1

    # ---- plumbing ------------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self._count(name, n)

    def _observe(self, op: str, seconds: float) -> None:
        """Under the lock: one write (the whole protocol: data, syncs, record) or read."""
        buckets, total = self._latency[op]
        buckets[bisect.bisect_left(IO_SECONDS_BUCKETS, seconds)] += 1
        total[0] += seconds

    def io_latency(self) -> dict[str, tuple[list[tuple[float, int]], float]]:
        """Per op: cumulative (upper bound, count) pairs ending with +Inf, and the sum of seconds."""
        out = {}
        with self.lock:
            for op, (buckets, total) in self._latency.items():
                cumulative, running = [], 0
                for bound, n in zip([*IO_SECONDS_BUCKETS, float("inf")], buckets, strict=True):
                    running += n
                    cumulative.append((bound, running))
                out[op] = (cumulative, total[0])
        return out

    def _write_record(self, record: Record) -> None:
        data = encode_record(record, self.header.file_id)
        offset = self.geometry.index_offset + record.slot * RECORD_BYTES
        if self.direct:  # from this thread's own aligned sector (was: a fresh mapping per record)
            buf: mmap.mmap | None = getattr(self._record_buffers, "buf", None)
            if buf is None:
                buf = self._record_buffers.buf = prefaulted_buffer(RECORD_BYTES)
            buf[:RECORD_BYTES] = data
            with memoryview(buf) as view:
                self.io.write_record(self._direct_fd, view[:RECORD_BYTES], offset)
        else:
            self.io.write_record(self._fd, memoryview(data), offset)

    def _write_records(self, records: list[Record]) -> None:
        """Records of adjacent slots in one write each run (each record its own sector, with its
        own checksum: a torn run leaves whole records before the tear and none after)."""
        runs: list[list[Record]] = []
        for record in sorted(records, key=lambda r: r.slot):
            if runs and runs[-1][-1].slot + 1 == record.slot:
                runs[-1].append(record)
            else:
                runs.append([record])
        for run in runs:
            if len(run) == 1:
                self._write_record(run[0])
                continue
            data = b"".join(encode_record(r, self.header.file_id) for r in run)
            offset = self.geometry.index_offset + run[0].slot * RECORD_BYTES
            if not self.direct:
                self.io.write_record(self._fd, memoryview(data), offset)
                continue
            buf = self.write_buffers.take(len(data))
            try:
                with memoryview(buf) as view:
                    view[: len(data)] = data
                    self.io.write_record(self._direct_fd, view[: len(data)], offset)
            finally:
                self.write_buffers.give(buf)

    @staticmethod
    def local(slot: int) -> int:
        return slot - SSD_SLOT_BASE

    # ---- writes --------------------------------------------------------------------------------

    def write(self, source: memoryview, key: bytes, digest: bytes) -> tuple[int, int]:
        """Store `source` (its XXH3-128 is `digest`, which the caller vouches for) durably; returns
        its wire (slot, generation). Raises `NoCapacity` (tier full), `Busy` (I/O queue),
        `Unavailable` (I/O error: nothing stored, nothing held)."""
        (done,) = self.write_many([(source, key, digest)])
        if isinstance(done, KvfError):
            raise done
        return done

    def write_many(
        self,
        items: Sequence[tuple[memoryview, bytes, bytes]],
        before_each: Callable[[], object] | None = None,
        refuse: tuple[AbstractContextManager[object], Callable[[int], KvfError | None]] | None = None,
    ) -> list[tuple[int, int] | KvfError]:
        """`write` for several objects (source, key, digest), their steps shared: their slots taken
        at once (the lowest free ids: adjacent on a fresh tier, scattered after frees), every
        object's data written one after another (each through the I/O engine), one sync, every
        commit record (each run of adjacent slots' records in one write), one sync. Per object,
        in order, its wire (slot, generation) or its error, as `write` would raise it; a
        `NoCapacity` is that object's alone: the ones after it are tried (a smaller
        one may fit a hole this one did not; review, stop 65: they were all refused
        `no_capacity`, and the policy dropped them instead of demoting). Each object's protocol
        is `write`'s: its data durable before its commit record is written, readable once that
        record is durable. `before_each` runs before each object's data is written (the
        backend's yield to GETs). `refuse` (lock, check): in the step that makes the objects
        readable, under `lock` (taken before the tier's own), `check(i)` says whether object `i`
        may be stored: an error (a demotion whose ticket a newer directory leader fenced) undoes
        it like a commit that was not durable — its free record written, the slot freed — and is
        its outcome; None stores it. `Unavailable` for all, raised, once a sync has failed."""
        if self._sync.failed is not None:
            raise Unavailable(
                "the disk tier failed a sync earlier: no writes until restart", reason="ssd_failed"
            )
        out: list[tuple[int, int] | KvfError | None] = [None] * len(items)
        started = time.perf_counter()
        allocs: list[tuple[int, DiskAlloc]] = []
        with self.lock:  # all at once: adjacent ids where free, their commit records in one write
            for i, (source, key, _) in enumerate(items):
                try:
                    allocs.append((i, self.table.alloc(len(source), key)))
                except KvfError as exc:  # NoCapacity too: this object's own
                    out[i] = exc
        written: list[tuple[int, DiskAlloc]] = []
        for n, (i, alloc) in enumerate(allocs):
            try:
                if before_each is not None:
                    before_each()
                self._write_data(items[i][0], alloc.offset, alloc.extent_bytes)
            except (OSError, KvfError) as exc:
                with self.lock:
                    self.table.abort(alloc.slot, alloc.generation)
                    self._count("writes_failed_total")
                out[i] = exc if isinstance(exc, KvfError) else Unavailable(f"disk tier write failed: {exc!r}")
                continue
            except BaseException:  # nothing left held: the others allocated are aborted too
                with self.lock:
                    for _, other in [*written, *allocs[n:]]:
                        self.table.abort(other.slot, other.generation)
                raise
            written.append((i, alloc))
        if written:
            self._commit_many(items, written, out, started, refuse)
        return [o if o is not None else Unavailable("not written") for o in out]

    def _commit_many(
        self,
        items: Sequence[tuple[memoryview, bytes, bytes]],
        written: list[tuple[int, DiskAlloc]],
        out: list[tuple[int, int] | KvfError | None],
        started: float,
        refuse: tuple[AbstractContextManager[object], Callable[[int], KvfError | None]] | None = None,
    ) -> None:
        """Steps 3-7 of the write protocol for objects whose data is written: sync, commit records,
        sync, readable (unless `refuse` says otherwise: `write_many`); each object's outcome into
        `out`."""
        try:
            self._sync.sync()
        except (OSError, KvfError) as exc:
            with self.lock:
                for _, alloc in written:
                    self.table.abort(alloc.slot, alloc.generation)
                    self._count("writes_failed_total")
            error = exc if isinstance(exc, KvfError) else Unavailable(f"disk tier write failed: {exc!r}")
            for i, _ in written:
                out[i] = error
            return
        committing: list[tuple[int, DiskAlloc, Record]] = []
        with self.lock:
            for i, alloc in written:
                record = self.table.begin_commit(alloc.slot, alloc.generation, items[i][2])
                if record is None:  # freed while writing (it was never visible): nothing to undo
                    out[i] = StaleGeneration("slot_generation", alloc.generation, alloc.generation + 1)
                else:
                    committing.append((i, alloc, record))
        durable = True
        try:
            self._write_records([record for _, _, record in committing])
            self._sync.sync()
        except (OSError, KvfError):
            durable = False
        unlinks: list[Record] = []
        seconds = time.perf_counter() - started
        outer, check = refuse if refuse is not None else (contextlib.nullcontext(), None)
        with outer, self.lock:  # the caller's lock first (the backend's: its fence rises under it)
            for i, alloc, _ in committing:
                refused = check(i) if check is not None and durable else None
                unlink = self.table.end_commit(alloc.slot, alloc.generation, durable and refused is None)
                if refused is not None:  # not stored: its free record below, then the slot is free
                    self._count("writes_refused_total")
                    if unlink is not None:
                        unlinks.append(unlink)
                    out[i] = refused
                    continue
                if unlink is None:
                    self._count("writes_total")
                    self._count("write_bytes_total", len(items[i][0]))
                    self._count("write_us_total", int(seconds * 1e6))
                    self._observe("write", seconds)
                    out[i] = (SSD_SLOT_BASE + alloc.slot, alloc.generation)
                    continue
                unlinks.append(unlink)
                out[i] = (
                    Unavailable("disk tier commit failed: the object was not stored")
                    if not durable
                    else StaleGeneration("slot_generation", alloc.generation, alloc.generation + 1)
                )
        if unlinks:
            self._unlink(unlinks)

    def _write_data(self, source: memoryview, offset: int, extent_bytes: int) -> None:
        position = self.geometry.data_offset + offset
        if not self.direct:
            self.io.pwrite(self._fd, source, position)
            return
        # O_DIRECT: memory, offset and length block-aligned. A source that is not (an arena slot
        # is 64-byte aligned) goes through a bounce buffer; the tail block is zero-padded.
        address = int(np.frombuffer(source, dtype=np.uint8).ctypes.data) if len(source) else 0
        if address % BLOCK_BYTES == 0 and len(source) == extent_bytes:
            self.io.pwrite(self._direct_fd, source, position)
            return
        buf = self.write_buffers.take(extent_bytes)
        try:
            with memoryview(buf) as view:
                view[: len(source)] = source
                view[len(source) : extent_bytes] = bytes(extent_bytes - len(source))  # no stale bytes
                self.io.pwrite(self._direct_fd, view[:extent_bytes], position)
        finally:
            self.write_buffers.give(buf)

    # ---- frees ---------------------------------------------------------------------------------

    def free_many(self, slots: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The directory's frees of disk slots (wire ids). Returned, in order: those the directory
        may stop retrying — freed (its free record durable before this returns, one sync for
        all), deferred behind a read with its record durable, freed already with it durable, or
        never held here. Not returned: a free whose record is not durable (its write or the
        sync failed: the slot stays held, `retry_unlinks` writes it again; or another thread is
        writing it) or of an object still being written (its writer may write a free record
        yet): the directory asks again. An acknowledged free whose record was lost came back
        at the next start (review, 2026-12-07: every free was returned, whatever its record's fate).
        Returned though not durable (counted `frees_acknowledged_undurable_total`): every free
        once a sync failed, and one whose own record has failed for `UNLINK_GIVE_UP_S`."""
        records: list[Record] = []
        with self.lock:
            for slot, generation in slots:
                try:
                    result = self.table.free(self.local(slot), generation)
                except NotFound:
                    self._count("free_unknown_slot_total")
                    continue
                if result.record is not None:
                    records.append(result.record)
        if records:
            self._unlink(records)
        now = self._clock()
        with self.lock:
            sync_failed = self._sync.failed is not None
            out: list[tuple[int, int]] = []
            undurable = 0
            for slot, generation in slots:
                local = self.local(slot)
                if self.table.free_durable(local, generation):
                    out.append((slot, generation))
                elif sync_failed or self._gave_up(local, generation, now):
                    # Its record cannot be made durable (after a failed sync nothing written
                    # counts) or has failed for `UNLINK_GIVE_UP_S` (a bad index sector): held
                    # unanswered, every group with a disk replica here stayed `evicting` at the
                    # directory for good (its keys refused, its bytes counted to its tenant).
                    # Acknowledged as a crash would leave it: the restart's recovery reports what
                    # came back, and the directory adopts or frees it. Its slot stays held here
                    # and its record is still retried.
                    undurable += 1
                    out.append((slot, generation))
            if undurable:
                self._count("frees_acknowledged_undurable_total", undurable)
            return out

    def _gave_up(self, local: int, generation: int, now: float) -> bool:
        """Whether the free record of (local slot, object generation) has been failing for
        `UNLINK_GIVE_UP_S` (under the lock). Its own record's first failure: not other frees'."""
        failing = self._unlink_failing.get(local)
        return failing is not None and failing[0] == generation + 1 and now - failing[1] >= UNLINK_GIVE_UP_S

    def _unlink(self, records: list[Record]) -> None:
        """Write free records and sync once, then let the table reuse the extents of those that
        are durable (`unlinked`). A record whose write fails is handed back to the table
        (`unlink_failed`: its slot stays held, `retry_unlinks` writes it again; only these, never a
        record another thread is writing) and the others are still written: this stopped at the
        first failure, and `take_failed_unlinks` hands records back by slot, so one bad index
        sector failed every retry batch it led and the records after it were never written
        (review, 2026-12-07). A failed sync hands back every record written (none is durable).
        The first failure of each record is remembered (`_unlink_failing`, `free_many`)."""
        written: list[Record] = []
        failed: list[Record] = []
        for record in records:
            try:
                self._write_record(record)
            except (OSError, KvfError):
                failed.append(record)
            else:
                written.append(record)
        if written:
            try:
                self._sync.sync()
            except (OSError, KvfError):
                failed += written  # none of them is durable
                written = []
        now = self._clock()
        with self.lock:
            for record in written:
                self._unlink_failing.pop(record.slot, None)
                self.table.unlinked(record.slot, record.generation)
            if failed:
                self._count("unlinks_failed_total", len(failed))
                self.table.unlink_failed(failed)
                self.unlinks_pending = True
                for record in failed:
                    known = self._unlink_failing.get(record.slot)
                    if known is None or known[0] != record.generation:  # its first failure
                        self._unlink_failing[record.slot] = (record.generation, now)

    def retry_unlinks(self) -> int:
        """Write again the free records whose write failed; 0 once a sync failed (nothing written
        after that counts: their extents stay held until a restart recovers the file)."""
        if self._sync.failed is not None or not self.unlinks_pending:
            return 0
        with self.lock:
            self.unlinks_pending = False  # set again if this retry fails too
            pending = self.table.take_failed_unlinks()
        if pending:
            self._unlink(pending)
        return len(pending)

    # ---- reads ---------------------------------------------------------------------------------

    def _begin_read(
        self, slot: int, generation: int, size: int, own_share: bool = True
    ) -> SsdRead | tuple[int, DiskGrant, bytes, bytes]:
        """A read's grant, its bytes counted in flight: (local slot, grant, key, the tenant it is
        counted for), or the `SsdRead` of a slot that cannot be read; `Busy` at the in-flight
        byte limit (one read always may) or past a tenant's share (`own_share`: a tenant's read,
        not the segment's own)."""
        local = self.local(slot)
        with self.lock:
            try:
                grant = self.table.acquire(local, generation, size)
            except StaleGeneration:
                return SsdRead("stale_generation")
            except BadRequest:
                return SsdRead("wrong_size")
            except KvfError:
                return SsdRead("not_found")
            held = self.table.held_one(local, generation)
            key = held.key if held is not None else b""
            tenant = tenant_of(key) if own_share else _SEGMENTS_OWN
            extent = grant.extent_bytes
            in_flight = self.read_bytes_in_flight
            if in_flight and in_flight + extent > self.read_bytes_max:
                self.table.release(local, generation)
                self._count("reads_busy_total")
                raise Busy(
                    "disk tier reads in flight at their byte limit", read_bytes_max=self.read_bytes_max
                )
            # One tenant's reads leave a share of the budget to the others (a read always may when
            # none is in flight): a reader that took its replies slowly held the whole budget for
            # the transfer's deadline, and every other tenant's disk GETs were busy (review,
            # 2026-12-06). Its first read too: one of most of the budget locked the others out
            # (review, stop 70). Not a quarter *at most*: with tenants off every key is one
            # tenant's, whose reads would have had a quarter of the budget. The segment's own
            # reads (`verify`) are not a tenant's.
            tenant_in = self._read_bytes_by_tenant.get(tenant, 0)
            most = self.read_bytes_max - self.read_bytes_max // READ_TENANT_SHARE_DIVISOR
            if own_share and self.read_bytes_in_flight and tenant_in + extent > most:
                self.table.release(local, generation)
                self._count("reads_busy_tenant_total")
                raise Busy("a tenant's disk tier reads in flight at its share", share_bytes=most)
            self.read_bytes_in_flight += extent
            self._read_bytes_by_tenant[tenant] = tenant_in + extent
        return local, grant, key, tenant

    def _read_ended(self, tenant: bytes, extent: int) -> None:
        """A read's bytes go back to the budget and its tenant's share (under the lock)."""
        self.read_bytes_in_flight -= extent
        left = self._read_bytes_by_tenant.get(tenant, 0) - extent
        if left > 0:
            self._read_bytes_by_tenant[tenant] = left
        else:
            self._read_bytes_by_tenant.pop(tenant, None)  # (no entry per tenant ever seen)

    def read(self, slot: int, generation: int, size: int, *, own_share: bool = True) -> SsdRead:
        """Read a stored object (wire slot id) into a private buffer and verify it. `corrupt`: the
        bytes (or the device) failed, the slot is freed now; tell the directory. `own_share`:
        counted against its key's tenant (False: the segment's own read)."""
        begun = self._begin_read(slot, generation, size, own_share)
        if isinstance(begun, SsdRead):
            return begun
        local, grant, key, tenant = begun
        extent = grant.extent_bytes
        pool = self.read_buffers
        lent: list[mmap.mmap] = []  # the pool's buffer, until given back (once)

        def give_back() -> None:
            with self.lock:
                self._read_ended(tenant, extent)
            if lent:
                pool.give(lent.pop())

        started = time.perf_counter()
        ok = False
        try:
            lent.append(pool.take(extent))
        except (OSError, MemoryError):
            with self.lock:
                self.table.release(local, generation)
            give_back()
            raise Busy("no memory for a disk read buffer", size=extent) from None
        buf = lent[0]
        try:
            with memoryview(buf) as whole:
                piece = whole[:extent]
                try:
                    self.io.pread(
                        self.data_fd,
                        piece,
                        self.geometry.data_offset + grant.offset,
                        owner=tenant if own_share else None,  # its pieces' share too (`SsdIo`)
                    )
                    ok = checksum(piece[:size]) == grant.checksum
                finally:
                    piece.release()
        except OSError:
            self.count("read_errors_total")
        except BaseException:  # Busy from the I/O engine, or worse: nothing held afterwards
            with self.lock:
                self.table.release(local, generation)
            give_back()
            raise
        with self.lock:
            self.table.release(local, generation)
            if ok:
                self._count("reads_total")
                self._count("read_bytes_total", size)
                self._count("read_us_total", int((time.perf_counter() - started) * 1e6))
                self._observe("read", time.perf_counter() - started)
        if ok:
            return SsdRead("ok", memoryview(buf)[:size], grant.checksum, key, generation, give_back)
        give_back()
        self.count("read_corrupt_total")
        self.free_many([(slot, generation)])
        return SsdRead("corrupt", key=key, generation=generation)

    def read_stream(
        self,
        slot: int,
        generation: int,
        size: int,
        *,
        inline_first: bool = True,
        alone: bool = False,
        share_wait_until: float = 0.0,
    ) -> SsdRead | SsdStream:
        """`read`, sent as it lands: the same checks and bounds up front (an `SsdRead` with the
        status when the slot cannot be read; `Busy`), then an `SsdStream` whose pieces (the I/O
        engine's, `KVF_SEGMENT_SSD_IO_CHUNK_BYTES`) are being read. Its verdict comes after the
        bytes (`SsdStream.verdict`). The first piece is read by the sender itself when it first
        waits for it (no hand-off), the others on the I/O engine's threads at once: a GET's later
        disk objects (`inline_first=False`, queued before the sender reads the first) are read
        while the first is read and sent. `inline_first=False` (the second and later disk
        objects of one GET): every piece goes to the I/O engine's threads and this returns at
        once, so they are read while the objects before them are sent.

        `alone` (a GET's only disk object, of at most one chunk, with `stream_head_divisor` N > 1):
        two pieces, both read by the sender — a head of about 1/N of it (`stream_head_bytes`:
        whole 64 KiB), which it sends before it reads the rest, so the client takes the head off
        the socket while the disk reads the rest (no thread hand-off; two reads instead of one).
        Not queued together: pieces queued at once land together on this VM's disk. Not for
        several disk objects: their later objects are read while the first is sent already. Off
        by default: measured no gain on the shared VM (docs/ssd-tier.md "Figures")

        `share_wait_until` (`time.monotonic()` seconds; 0: not at all): past its tenant's share
        of the I/O queue's pieces, this waits until then for them to drain before it is `Busy`
        (`SsdIo._admit`): a GET's earlier objects, queued on the threads, leave the queue in a
        disk read's time each, so a GET of more one-piece objects than the share is not refused
        by its own. Called on a sender's thread, holding no lock (its bytes and the slot's read
        reference are held meanwhile, as for the read)."""
        begun = self._begin_read(slot, generation, size)
        if isinstance(begun, SsdRead):
            return begun
        local, grant, key, tenant = begun
        extent = grant.extent_bytes
        pool = self.read_buffers
        lent: list[mmap.mmap] = []

        def give_back() -> None:
            with self.lock:
                self._read_ended(tenant, extent)
            if lent:
                pool.give(lent.pop())

        try:
            lent.append(pool.take(extent))
            with memoryview(lent[0]) as whole:
                chunk = self.io.chunk_bytes
                split = alone and inline_first and self.stream_head_divisor > 1 and extent <= chunk
                pieces = self.io.submit_read(
                    self.data_fd,
                    whole[:extent],
                    self.geometry.data_offset + grant.offset,
                    chunk,
                    inline_first=inline_first,
                    head_bytes=stream_head_bytes(extent, chunk, self.stream_head_divisor) if split else 0,
                    owner=tenant,  # its pieces' share of the I/O queue (`SsdIo`)
                    wait_until=share_wait_until,
                )
        except BaseException as exc:
            with self.lock:
                self.table.release(local, generation)
            give_back()
            if isinstance(exc, (OSError, MemoryError)):
                raise Busy("no memory for a disk read buffer", size=extent) from None
            raise
        return SsdStream(self, slot, generation, size, grant.checksum, key, lent[0], pieces, give_back)

    def verify(self, slot: int, generation: int, size: int) -> ReadStatus:
        result = self.read(slot, generation, size, own_share=False)  # the segment's own check
        result.release()
        return result.status

    # ---- listing -------------------------------------------------------------------------------

    def held(self, after_slot: int = -1, limit: int = 1 << 30) -> list[DiskHeld]:
        """STORED objects with wire slot id > `after_slot`, lowest first, as wire ids."""
        with self.lock:
            page = self.table.held(max(after_slot - SSD_SLOT_BASE, -1), limit)
        return [DiskHeld(SSD_SLOT_BASE + h.slot, h.generation, h.size, h.checksum, h.key) for h in page]

    def held_one(self, slot: int, generation: int) -> DiskHeld | None:
        with self.lock:
            h = self.table.held_one(self.local(slot), generation)
        return None if h is None else DiskHeld(slot, h.generation, h.size, h.checksum, h.key)

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {
                "capacity_bytes": self.table.data_bytes,
                "used_bytes": self.table.used_bytes,
                "stored_bytes": self.table.stored_bytes,
                "objects": self.table.objects,
                "slots_in_use": self.table.slots_in_use,
                "read_bytes_in_flight": self.read_bytes_in_flight,
                "io_pieces_in_flight": self.io.pieces_in_flight,
                "failed": int(self._sync.failed is not None),
            }

    def all_counters(self) -> dict[str, int]:
        with self.lock:
            out = {f"ssd_{k}": v for k, v in self.table.counters.items()}
            out.update({f"ssd_{k}": v for k, v in self.counters.items()})
        out["ssd_io_busy_total"] = self.io.busy_total
        out["ssd_io_busy_tenant_total"] = self.io.busy_tenant_total
        out["ssd_io_share_waits_total"] = self.io.share_waits_total
        out["ssd_io_share_wait_timeouts_total"] = self.io.share_wait_timeouts_total
        out["ssd_syncs_total"] = self._sync.syncs_total
        out["ssd_sync_us_total"] = int(self._sync.sync_seconds_total * 1e6)
        return out

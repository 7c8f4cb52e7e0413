"""The disk tier's file after a crash at every step of its write protocol (real files, real recovery).

`test_every_crash_point_recovers_exactly_the_complete_objects` runs a workload against a real
`SsdTier` whose I/O engine records every write (offset, bytes) and every sync, in order. Then,
for every point in that history (after each write and each sync), it builds what the disk could
hold had the power gone there: everything synced before it, and of the writes since the last
sync each one lost, kept, or torn (only its first sectors, or only its first bytes, made it) in
several combinations. It opens a tier on each such image (the segment's start-up recovery,
unmodified) and checks:

- nothing torn or unchecksummed: every recovered object reads back `ok` (the tier's read checks
  XXH3-128) and holds exactly the bytes written under its key;
- nothing lost: every object whose `write` had returned before that point and that no free had
  touched is recovered, same slot, generation and bytes;
- nothing else: a recovered key is one the workload wrote;
- accounting: freeing everything recovered leaves the data region empty.

`test_sigkill_during_writes_and_frees` kills a writer process (SIGKILL) at random moments while
it writes and frees, then recovers its file: the page cache survives a process kill, so this
checks the other half: that the protocol's order of steps never leaves a half-made object
behind, whatever instruction the process dies on.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfabric.core.disk_records import RECORD_BYTES, geometry
from kvfabric.format.checksum import checksum
from kvfabric.proto.segment import SSD_SLOT_BASE
from kvfabric.segment_storage.ssd import SsdIo, SsdTier, ssd_file_path

SEGMENT = "crash-1"
DATA_BYTES = 256 << 10
SLOTS = 16
SECTOR = 512


def content(key: bytes, size: int) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(key + counter.to_bytes(4, "little"), digest_size=64).digest()
        counter += 1
    return bytes(out[:size])


@dataclass
class Event:
    kind: str  # "write" | "sync"
    offset: int = 0
    data: bytes = b""


class RecordingIo(SsdIo):
    """Does every write for real and records it, in order; the tier's sync records a barrier."""

    def __init__(self) -> None:
        super().__init__(0, 64, 4096)  # small pieces: a data write is several events
        self.events: list[Event] = []
        self.recording = False

    def _piece(self, fd: int, view: memoryview, offset: int, write: bool) -> None:
        super()._piece(fd, view, offset, write)
        if write and self.recording:
            self.events.append(Event("write", offset, bytes(view)))

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)
        if self.recording:
            self.events.append(Event("sync"))


def open_tier(directory: Path, io: SsdIo, sync: Callable[[int], None] = os.fdatasync) -> SsdTier:
    return SsdTier(
        directory, SEGMENT, DATA_BYTES, SLOTS, direct=False, io=io, read_bytes_max=1 << 30, sync=sync
    )


@dataclass
class Outcome:
    """What the workload knew at one event index."""

    acked: dict[bytes, tuple[int, int, int]]  # key -> (slot, generation, size): write returned, no free yet
    written: set[bytes]  # every key a write was started for


def run_workload(directory: Path) -> tuple[bytes, list[Event], list[Outcome], dict[bytes, int]]:
    """Writes, frees (so extents and slot ids are reused) and more writes; returns the file as it
    was before the workload, the recorded events, and per event index what had been acknowledged."""
    io = RecordingIo()
    tier = open_tier(directory, io, io.sync)
    path = ssd_file_path(directory, SEGMENT)
    before = path.read_bytes()
    rng = random.Random(7)
    sizes: dict[bytes, int] = {}
    live: dict[bytes, tuple[int, int, int]] = {}
    written: set[bytes] = set()
    outcomes: list[Outcome] = [Outcome({}, set())]
    io.recording = True

    def mark() -> None:
        while len(outcomes) <= len(io.events):
            outcomes.append(Outcome(dict(live), set(written)))

    for step in range(14):  # with 16 slots and 256 KiB: frees make room for what follows
        if live and (step % 3 == 2):
            victims = rng.sample(sorted(live), k=min(len(live), rng.choice((1, 2))))
            pairs = [(live[key][0], live[key][1]) for key in victims]
            for key in victims:  # the free starts: from now on the object may be gone
                del live[key]
            mark()
            tier.free_many(pairs)
            mark()
            continue
        # Every fourth step writes three objects at once (`write_many`: data, one sync, their
        # commit records in one write, one sync), the others one (`write`).
        keys = [f"object-{step}-{k}".encode() for k in range(3 if step % 4 == 1 else 1)]
        batch = []
        for key in keys:
            size = rng.choice((1, 4000, 4096, 9000, 20_000))
            data = content(key, size)
            sizes[key] = size
            written.add(key)
            batch.append((memoryview(data), key, checksum(data)))
        mark()
        if len(batch) == 1:
            results: list[object] = [tier.write(*batch[0])]
        else:
            results = list(tier.write_many(batch))
        mark()
        for (view, key, _), result in zip(batch, results, strict=True):
            assert isinstance(result, tuple), result
            live[key] = (result[0], result[1], len(view))
    io.recording = False
    tier.close()
    return before, io.events, outcomes, sizes


def crash_images(before: bytes, events: list[Event], point: int, rng: random.Random) -> list[bytes]:
    """Disk images for a power loss right after `events[:point]`."""
    last_sync = max((i + 1 for i, e in enumerate(events[:point]) if e.kind == "sync"), default=0)
    base = bytearray(before)
    for e in events[:last_sync]:
        if e.kind == "write":
            base[e.offset : e.offset + len(e.data)] = e.data
    pending = [e for e in events[last_sync:point] if e.kind == "write"]
    variants: list[list[str]] = [["lost"] * len(pending), ["kept"] * len(pending)]
    for _ in range(4):
        variants.append([rng.choice(("lost", "kept", "sectors", "bytes")) for _ in pending])
    if pending:  # only the newest write torn, the rest kept (the usual shape of a power loss)
        variants.append(["kept"] * (len(pending) - 1) + ["sectors"])
        variants.append(["kept"] * (len(pending) - 1) + ["bytes"])
    images = []
    for fates in variants:
        image = bytearray(base)
        for e, fate in zip(pending, fates, strict=True):
            if fate == "kept":
                image[e.offset : e.offset + len(e.data)] = e.data
            elif fate == "sectors" and len(e.data) > SECTOR:
                cut = rng.randrange(1, len(e.data) // SECTOR + 1) * SECTOR
                image[e.offset : e.offset + cut] = e.data[:cut]
            elif fate in ("sectors", "bytes") and len(e.data) > 1:
                cut = rng.randrange(1, len(e.data))
                image[e.offset : e.offset + cut] = e.data[:cut]
        images.append(bytes(image))
    return images


def check_recovery(
    directory: Path, image: bytes, outcome: Outcome, sizes: dict[bytes, int], where: str
) -> None:
    path = ssd_file_path(directory, SEGMENT)
    path.write_bytes(image)
    io = SsdIo(0, 64, 1 << 20)
    tier = open_tier(directory, io)
    try:
        held = {h.key: h for h in tier.held()}
        for key, h in held.items():
            assert key in outcome.written, f"{where}: recovered {key!r}, never written"
            result = tier.read(h.slot, h.generation, h.size)
            assert result.status == "ok", f"{where}: recovered a torn object {key!r}: {result.status}"
            assert result.view is not None and bytes(result.view) == content(key, sizes[key]), where
            result.release()
        for key, (slot, generation, size) in outcome.acked.items():
            found = held.get(key)
            assert found is not None, f"{where}: lost acknowledged {key!r}"
            assert (found.slot, found.generation, found.size) == (slot, generation, size), where
        tier.free_many([(h.slot, h.generation) for h in held.values()])
        assert tier.stats()["used_bytes"] == 0, where
        assert tier.table.free_extents() == [(0, DATA_BYTES)], where
    finally:
        tier.close()


def test_every_crash_point_recovers_exactly_the_complete_objects(tmp_path: Path) -> None:
    work = tmp_path / "work"
    before, events, outcomes, sizes = run_workload(work)
    assert sum(e.kind == "sync" for e in events) >= 10 and len(events) >= 40  # the workload did things
    index_end = geometry(SLOTS, DATA_BYTES).data_offset
    assert any(  # commit records of adjacent slots went in one write, which a crash may tear too
        e.kind == "write" and e.offset < index_end and len(e.data) > RECORD_BYTES for e in events
    )
    rng = random.Random(11)
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    checked = 0
    for point in range(len(events) + 1):
        for image in crash_images(before, events, point, rng):
            check_recovery(crash_dir, image, outcomes[point], sizes, f"crash after event {point}")
            checked += 1
    assert checked >= 300


def test_a_damaged_record_or_header_never_serves(tmp_path: Path) -> None:
    """A flipped byte in a commit record: that object is gone (not served wrong); in the header:
    the file is refused with a message saying so."""
    io = SsdIo(0, 64, 1 << 20)
    tier = open_tier(tmp_path, io)
    data = content(b"a", 5000)
    slot, _ = tier.write(memoryview(data), b"a", checksum(data))
    other = content(b"b", 5000)
    tier.write(memoryview(other), b"b", checksum(other))
    tier.close()
    path = ssd_file_path(tmp_path, SEGMENT)
    image = bytearray(path.read_bytes())
    image[tier.geometry.index_offset + (slot - SSD_SLOT_BASE) * RECORD_BYTES + 40] ^= 0x10
    path.write_bytes(bytes(image))
    tier = open_tier(tmp_path, io)
    assert [h.key for h in tier.held()] == [b"b"]
    tier.close()
    image[100] ^= 0x01  # the header
    path.write_bytes(bytes(image))
    with pytest.raises(Exception, match="damaged header"):
        open_tier(tmp_path, io)
    image[100] ^= 0x01
    path.write_bytes(bytes(image[: len(image) - 4096]))  # truncated
    with pytest.raises(Exception, match="truncated"):
        open_tier(tmp_path, io)


WRITER = r"""
import os, random, sys, hashlib
from pathlib import Path
sys.path.insert(0, {tests!r})
from kvfabric.format.checksum import checksum
from kvfabric.segment_storage.ssd import SsdIo, SsdTier
from test_ssd_crash import content, SEGMENT, DATA_BYTES, SLOTS
tier = SsdTier(Path({directory!r}), SEGMENT, DATA_BYTES, SLOTS, direct=False, io=SsdIo(2, 64, 4096),
               read_bytes_max=1 << 30)
rng = random.Random({seed})
live = []
i = 0
while True:
    i += 1
    if live and rng.random() < 0.4:
        key, slot, gen = live.pop(rng.randrange(len(live)))
        print("free", key, flush=True)
        tier.free_many([(slot, gen)])
        continue
    key = f"k{{{seed}}}-{{i}}"
    data = content(key.encode(), rng.choice((100, 4096, 30_000, 60_000)))
    try:
        slot, gen = tier.write(memoryview(data), key.encode(), checksum(data))
    except Exception as exc:
        print("full", key, repr(exc), flush=True)
        continue
    live.append((key, slot, gen))
    print("acked", key, len(data), flush=True)
"""


@pytest.mark.slow
def test_sigkill_during_writes_and_frees(tmp_path: Path) -> None:
    tests = str(Path(__file__).resolve().parent)
    rng = random.Random(3)
    for attempt in range(6):
        directory = tmp_path / f"run{attempt}"
        ssd_file_path(directory, SEGMENT).unlink(missing_ok=True)
        directory.mkdir()
        script = WRITER.format(tests=tests, directory=str(directory), seed=attempt)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        lines = [proc.stdout.readline()]  # started: it acknowledged (or refused) a first write
        time.sleep(rng.uniform(0.05, 1.0))
        proc.send_signal(signal.SIGKILL)
        out = "".join(lines) + proc.stdout.read()
        proc.wait(timeout=30)
        complete = out.split("\n")[:-1]  # a line the kill cut short says nothing
        acked: dict[str, int] = {}
        for line in complete:
            parts = line.split()
            if parts[0] == "acked":
                acked[parts[1]] = int(parts[2])
            elif parts[0] == "free":
                acked.pop(parts[1], None)  # the free began: may be gone or not
        assert any(line.startswith("acked") for line in complete), "killed before it wrote anything"
        freeing = {line.split()[1] for line in complete if line.startswith("free")}
        freeing |= {line.split()[1] for line in complete if line.startswith("full")}  # refused: never acked
        tier = open_tier(directory, SsdIo(0, 64, 1 << 20))
        try:
            held = {h.key.decode(): h for h in tier.held()}
            for key, h in held.items():
                result = tier.read(h.slot, h.generation, h.size)
                assert result.status == "ok" and result.view is not None, key
                assert bytes(result.view) == content(key.encode(), h.size), key
                result.release()
            for key in acked:
                assert key in held, f"attempt {attempt}: lost acknowledged {key}"
            # Whatever was recovered beyond that is one write in flight or a free in flight.
            extra = set(held) - set(acked) - freeing
            assert len(extra) <= 1, extra
            tier.free_many([(h.slot, h.generation) for h in held.values()])
            assert tier.stats()["used_bytes"] == 0
        finally:
            tier.close()

"""A demote request's `keep_arena` objects are copied, not moved (issue 23, whole prefixes on
disk): the eviction policy copies a demoted tail's DRAM-only ancestors into the disk tier so
that a power cycle, which loses the arena, leaves every disk object findable. Such an object is
written and confirmed like any demotion, then `copied`: its arena replica is neither dropped
(no `replica_corrupt` names it) nor freed, and both replicas hold its bytes. One the directory
already holds on disk (`already_there`) is `copied` at once, nothing written or dropped."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.segment import SSD_SLOT_BASE, DemoteObject
from kvfabric.segment_storage.ssd import ssd_file_path

from .test_demoter_batch import Directory, demote, make, stored
from .test_ssd_backend import INCARNATION, SEGMENT


class AlreadyThere(Directory):
    """Answers `already_there` for the keys in `on_disk` (an earlier copy put them on disk)."""

    def __init__(self, on_disk: set[bytes]) -> None:
        super().__init__(rtt_s=0.0)
        self.on_disk = on_disk

    def _begin(self, writer_id: str, k: ObjectKey) -> m.ReplicateBeginReply:
        if k in self.on_disk:
            self.begun.append(k)
            return m.ReplicateBeginReply(epoch=1, status="already_there")
        return super()._begin(writer_id, k)


def test_keep_arena_objects_are_copied_and_their_arena_replicas_stay(tmp_path: Path) -> None:
    seg = make(tmp_path, 16 << 20, [])
    directory = AlreadyThere(set())
    try:
        datas, objects = stored(seg, directory, 6, 64 * 1024)
        keep = {0, 2, 4}
        asked = [msgspec.structs.replace(o, keep_arena=i in keep) for i, o in enumerate(objects)]
        reply = demote(seg, directory, asked)
        assert [r.status for r in reply.results] == ["copied", "demoted"] * 3
        # only the moved objects' arena replicas were dropped
        assert sorted(directory.dropped) == sorted(objects[i].key for i in range(6) if i not in keep)
        assert len(directory.confirmed) == 6  # every disk replica is in the directory's record
        for i, (data, result) in enumerate(zip(datas, reply.results, strict=True)):
            assert result.slot >= SSD_SLOT_BASE
            read = seg.ssd.read(result.slot, result.slot_generation, len(data))
            assert read.status == "ok" and read.view is not None and bytes(read.view) == data
            read.release()
            if i in keep:  # the arena replica is still there, same slot, generation and bytes
                assert (
                    seg.backend.verify_stored(objects[i].slot, objects[i].slot_generation, len(data)) == "ok"
                )
    finally:
        seg.backend.arena.close()
        seg.io.close()
        seg.ssd.close()


def test_a_keep_arena_object_already_on_disk_is_copied_at_once(tmp_path: Path) -> None:
    seg = make(tmp_path, 16 << 20, [])
    directory = AlreadyThere(set())
    try:
        _, objects = stored(seg, directory, 2, 64 * 1024)
        directory.on_disk = {objects[0].key, objects[1].key}
        asked = [DemoteObject(objects[0].key, objects[0].slot, objects[0].slot_generation, keep_arena=True),
                 objects[1]]  # fmt: skip
        reply = demote(seg, directory, asked)
        # the kept one: copied, nothing written or dropped; the other: its arena replica dropped
        assert [r.status for r in reply.results] == ["copied", "demoted"]
        assert directory.dropped == [objects[1].key] and directory.confirmed == []
        assert seg.ssd.stats()["used_bytes"] == 0
    finally:
        seg.backend.arena.close()
        seg.io.close()
        seg.ssd.close()


def test_a_rotted_disk_copy_keeps_the_arena_copy_when_the_object_is_demoted_later(tmp_path: Path) -> None:
    """Review, 2026-12-06: a head copied with `keep_arena` is read by no one while its arena
    replica is listed first, and no scrub pass reads the disk tier: its disk copy could rot
    unseen, and demoting it later (`already_there`) dropped the arena replica on the word that
    the disk copy was held — the only good copy gone. Now the disk copy is read back first: a
    good one lets the arena copy go; a rotted one is freed and reported, and the arena copy stays."""
    seg = make(tmp_path, 16 << 20, [])
    directory = Directory(rtt_s=0.0)
    reported: list[tuple[bytes, int, int, int]] = []
    try:
        datas, objects = stored(seg, directory, 2, 64 * 1024)
        copies = demote(seg, directory, [msgspec.structs.replace(o, keep_arena=True) for o in objects])
        assert [r.status for r in copies.results] == ["copied", "copied"]
        rotted = copies.results[0]
        local = rotted.slot - SSD_SLOT_BASE
        with seg.ssd.lock:
            grant = seg.ssd.table.acquire(local, rotted.slot_generation, len(datas[0]))
            seg.ssd.table.release(local, rotted.slot_generation)
        fd = os.open(ssd_file_path(tmp_path / "ssd", SEGMENT), os.O_RDWR)
        try:  # one flipped bit in the first copy's data, on the disk
            at = seg.ssd.geometry.data_offset + grant.offset + 100
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        # Demoted later: the directory answers `already_there`, listing each disk copy.
        for o, copy in zip(objects, copies.results, strict=True):
            directory.already[o.key] = [
                m.Replica(segment_id=SEGMENT, incarnation=INCARNATION, slot=slot, slot_generation=generation)
                for slot, generation in ((copy.slot, copy.slot_generation), (o.slot, o.slot_generation))
            ]
        reply = demote(seg, directory, objects, reported=reported)
        assert [r.status for r in reply.results] == ["failed", "demoted"]
        assert directory.dropped == [objects[1].key]  # the good copy's arena replica went
        assert reported == [(objects[0].key, rotted.slot, rotted.slot_generation, len(datas[0]))]
        assert seg.ssd.held_one(rotted.slot, rotted.slot_generation) is None  # freed by the tier
        # the arena copy is intact and stays
        assert seg.backend.verify_stored(objects[0].slot, objects[0].slot_generation, len(datas[0])) == "ok"
    finally:
        seg.backend.arena.close()
        seg.io.close()
        seg.ssd.close()


def test_the_flag_is_optional_on_the_wire() -> None:
    """An older policy's objects (three fields) decode as moves."""
    old = msgspec.msgpack.encode([b"k" * 96, 3, 1])
    obj = msgspec.msgpack.decode(old, type=DemoteObject)
    assert obj.keep_arena is False and (obj.slot, obj.slot_generation) == (3, 1)

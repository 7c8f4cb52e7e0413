"""Index records with a valid digest that no table wrote (crafted or damaged: a record's digest is
keyed by the file id, which the header holds in the clear): recovery drops each commit record it
cannot take through the unlinks path (counted, superseded by a free record, synced), never lets
one crash the start or a later free, and anything else it raises is `SsdFileRefused` with what to
do (stop 70's list)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import kvfabric.segment_storage.ssd as ssd_module
from kvfabric.core.disk_records import (
    HEADER_BYTES,
    RECORD_BYTES,
    Record,
    decode_header,
    decode_record,
    encode_record,
)
from kvfabric.core.disk_slots import GENERATION_RECOVERED_MAX, DiskSlotTable
from kvfabric.format.checksum import checksum
from kvfabric.format.generations import GENERATION_MAX
from kvfabric.format.invariant import InvariantViolation
from kvfabric.proto.segment import SSD_SLOT_BASE
from kvfabric.segment_storage.ssd import SsdFileRefused, SsdIo, SsdTier, ssd_file_path

SEGMENT = "crafted-1"
DATA_BYTES = 64 << 10
SLOTS = 8
SUM = b"c" * 16
KEY = b"k" * 96


def open_tier(directory: Path, *, verify: bool = False) -> SsdTier:
    return SsdTier(
        directory,
        SEGMENT,
        DATA_BYTES,
        SLOTS,
        direct=False,
        io=SsdIo(0, 64, 1 << 20),
        read_bytes_max=1 << 20,
        verify_on_start=verify,
    )


def craft(directory: Path, records: list[Record]) -> None:
    """Write `records` into the index of the tier file in `directory`, each with a valid digest
    (the file id read from the header, as anyone who can write the file can)."""
    tier = open_tier(directory)
    file_id, index_offset = tier.header.file_id, tier.geometry.index_offset
    tier.close()
    with open(ssd_file_path(directory, SEGMENT), "r+b") as f:
        for record in records:
            f.seek(index_offset + record.slot * RECORD_BYTES)
            f.write(encode_record(record, file_id))


def index_record(directory: Path, slot: int) -> Record | None:
    """Slot `slot`'s record as the file holds it now (a tier may have it open)."""
    with open(ssd_file_path(directory, SEGMENT), "rb") as f:
        header = decode_header(f.read(HEADER_BYTES))
        f.seek(header.geometry.index_offset + slot * RECORD_BYTES)
        return decode_record(f.read(RECORD_BYTES), header.file_id, slot)


def cycle(tier: SsdTier, times: int) -> list[int]:
    """Write and free an object `times` times (each reuses the lowest slot id): its generations."""
    generations = []
    data = b"x" * 5000
    for _ in range(times):
        slot, generation = tier.write(memoryview(data), KEY, checksum(data))
        assert slot == SSD_SLOT_BASE
        generations.append(generation)
        tier.free_many([(slot, generation)])
        tier.table.check_invariants()
    return generations


@pytest.mark.parametrize("generation", [GENERATION_MAX - 1, GENERATION_MAX - 2, GENERATION_RECOVERED_MAX + 1])
def test_a_free_record_near_the_generation_max_does_not_exhaust_its_slot(
    tmp_path: Path, generation: int
) -> None:
    """A free record just below GENERATION_MAX gave slot 0's objects the last generations: the
    free of the one at GENERATION_MAX hit the "generation exhausted" invariant (from a directory's
    free, a corrupt read's, a refused demotion's), and its commit record would not decode at the
    next start. Past `GENERATION_RECOVERED_MAX` the slot starts again at 1."""
    craft(tmp_path, [Record("free", 0, generation)])
    tier = open_tier(tmp_path)
    try:
        assert cycle(tier, 4) == [1, 2, 3, 4]
    finally:
        tier.close()


def test_a_commit_record_near_the_generation_max_is_dropped_and_superseded(tmp_path: Path) -> None:
    """Recovered at GENERATION_MAX - 1, its free moved the slot to GENERATION_MAX and the next
    object there could not be freed. Dropped now (counted), its free record (generation 1)
    written before anything is allocated; the slot starts again at 1."""
    craft(tmp_path, [Record("commit", 0, GENERATION_MAX - 1, 0, 5000, SUM, KEY)])
    tier = open_tier(tmp_path)
    try:
        assert tier.held() == []
        assert tier.table.counters.get("recovery_dropped_total") == 1
        assert tier.table.counters.get("unlinks_total") == 1
        assert tier.table.used_bytes == 0
        assert cycle(tier, 3) == [1, 2, 3]
    finally:
        tier.close()
    assert index_record(tmp_path, 0) == Record("free", 0, 4)
    tier = open_tier(tmp_path)  # nothing left to drop
    assert "recovery_dropped_total" not in tier.table.counters
    tier.close()


def test_a_commit_record_larger_than_any_object_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A size up to the data region (1 PiB by the settings) recovered as one object: re-hashed at
    start (`KVF_SEGMENT_SSD_VERIFY_ON_START`) or read by a GET into one buffer of that size, a
    failed mapping escaping the start as `Busy`. No object above `OBJECT_BYTES_MAX` (what the
    data plane carries) was written: dropped. Shown with that bound lowered to 16 KiB."""
    monkeypatch.setattr(ssd_module, "OBJECT_BYTES_MAX", 16 << 10, raising=False)
    craft(
        tmp_path,
        [Record("commit", 0, 1, 0, 32 << 10, SUM, KEY), Record("commit", 1, 1, 32 << 10, 16 << 10, SUM, KEY)],
    )
    tier = open_tier(tmp_path, verify=True)
    try:
        assert tier.table.counters.get("recovery_dropped_total") == 1
        assert index_record(tmp_path, 0) == Record("free", 0, 2)
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("offset", "size"),
    [
        (0, 0),  # no bytes: no extent
        (4096, 2**64 - 1),  # larger than the data region
        (2**64 - 4096, 4096),  # the extent past the data region's end
        (DATA_BYTES - 4096, 8192),  # starts inside, ends past it
        (100, 4096),  # not block-aligned
    ],
)
def test_a_commit_record_outside_the_data_region_is_dropped_and_superseded(
    tmp_path: Path, offset: int, size: int
) -> None:
    craft(tmp_path, [Record("commit", 0, 3, offset, size, SUM, KEY)])
    tier = open_tier(tmp_path, verify=True)
    try:
        assert tier.held() == []
        assert tier.table.counters.get("recovery_dropped_total") == 1
        assert cycle(tier, 1) == [4]
    finally:
        tier.close()


def test_recovery_drops_what_no_table_wrote() -> None:
    """The pure rule: a size above `size_max`, a generation above `GENERATION_RECOVERED_MAX`, a
    key longer than a record holds are dropped (UNLINKING until their free records are durable);
    a free record past the bound restores nothing."""
    records: list[Record | None] = [
        Record("commit", 0, 1, 0, 8192, SUM, b"big"),
        Record("commit", 1, GENERATION_RECOVERED_MAX + 1, 8192, 100, SUM, b"gen"),
        Record("commit", 2, 0, 12288, 100, SUM, b"zero generation"),
        Record("commit", 3, 2, 16384, 100, SUM, b"k" * 1000),
        Record("free", 4, GENERATION_RECOVERED_MAX + 1),
        Record("commit", 5, GENERATION_RECOVERED_MAX, 20480, 4096, SUM, b"ok"),
    ]
    table, unlinks = DiskSlotTable.recover(1 << 16, records, size_max=4096)
    assert [(h.slot, h.generation) for h in table.held()] == [(5, GENERATION_RECOVERED_MAX)]
    assert unlinks == [Record("free", 0, 2), Record("free", 1, 1), Record("free", 2, 1), Record("free", 3, 3)]
    assert table.counters["recovery_dropped_total"] == 4
    for record in unlinks:
        table.unlinked(record.slot, record.generation)
    table.check_invariants()
    allocs = [table.alloc(100, b"k") for _ in range(5)]
    assert [(a.slot, a.generation) for a in allocs] == [(0, 2), (1, 1), (2, 1), (3, 3), (4, 1)]


def test_an_unexpected_error_recovering_the_index_is_refused_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last line: whatever else recovery raises (an invariant, a decoding error) is
    `SsdFileRefused` naming the file and the error, which the segment's `__main__` says and
    exits 2 on; it was a traceback, the segment restarted into the same."""
    open_tier(tmp_path).close()

    def broken(*args: Any, **kw: Any) -> Any:
        raise InvariantViolation("record of another slot")

    monkeypatch.setattr(DiskSlotTable, "recover", broken)
    with pytest.raises(SsdFileRefused, match="record of another slot") as refused:
        open_tier(tmp_path)
    assert str(ssd_file_path(tmp_path, SEGMENT)) in str(refused.value)
    assert "remove it to start empty" in str(refused.value)
    monkeypatch.undo()

    def undecodable(*args: Any, **kw: Any) -> Any:
        raise ValueError("bad record")

    monkeypatch.setattr(ssd_module, "decode_record", undecodable)
    with pytest.raises(SsdFileRefused, match="bad record"):
        open_tier(tmp_path)

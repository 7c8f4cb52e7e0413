"""The disk slot table and its write protocol against a simulated disk, with crashes (Hypothesis).

The machine plays the segment's disk tier: it allocates, writes data blocks, syncs, writes the
commit records `begin_commit` hands out, reads, frees and writes the free records, on a
simulated disk that keeps what was synced and may lose or keep each write made since the last
sync — and may tear an index record (it then does not decode). A `crash` rule can come at any
step: it draws what the disk holds afterwards (per data block and per record: the synced value
or any later write; a record may also be torn), recovers a new table from that index exactly as
the shell does (`decode_record` over every slot, `DiskSlotTable.recover`, the dropped records'
free records written and synced) and checks:

- never a torn object: every recovered object's blocks all hold its own bytes (its checksum is
  the id of the object whose bytes are there);
- never a lost object: every object whose commit was acknowledged (`end_commit` made it STORED)
  and that no free has touched is recovered, same slot, generation, extent, checksum and key;
- nothing else: a recovered object is one that began a commit (no invented records);
- accounting: `check_invariants()` after every step, used + free == data region; at the end
  every object is freed and unlinked and `used_bytes` is 0 with one free extent left.

And after every step, without crashing (`every_crash_recoverable`), the same two properties for
every outcome a crash at that instant could have at once: each commit record the disk could
hold (synced, or written since) names bytes that are certainly its object's, no two overlap, and
every acknowledged object's record is synced. So a protocol step out of order is found at the
step itself, not only when a drawn crash happens to hit it (checked: letting `begin_commit` run
before the data is synced, or `unlinked` before the free record is, fails this test).

The model also checks the allocator (no extent or slot id handed out while held, including an
extent whose free record is not durable yet), generations (acquire of a freed generation is
`StaleGeneration`), and that nothing is readable before `end_commit`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfabric.core.disk_records import Record, decode_record, encode_record
from kvfabric.core.disk_slots import DiskSlotTable
from kvfabric.format.errors import NoCapacity, NotFound, StaleGeneration

FILE_ID = b"F" * 16
TORN = "torn"


def object_checksum(object_id: int) -> bytes:
    return object_id.to_bytes(16, "big")


@dataclass
class Op:
    """One object through the write protocol (the test is its writer)."""

    object_id: int
    slot: int
    generation: int
    offset: int
    size: int
    extent: int
    key: bytes
    step: str = "allocated"  # allocated, written, committing, stored, unlinking, done
    data_seq: int = -1  # the write sequence number of its data (durable once synced past it)
    record_seq: int = -1  # of its commit record
    free_seq: int = -1  # of its free record
    fenced: bool = False  # freed while being written or committed
    readers: int = 0
    unlink_generation: int = 0


@dataclass
class Disk:
    """Synced contents plus the writes since the last sync, in order."""

    blocks: dict[int, int] = field(default_factory=dict)  # block -> object id whose bytes are there
    records: dict[int, bytes] = field(default_factory=dict)  # slot -> record bytes
    pending: list[tuple[str, int, object, int]] = field(default_factory=list)  # (kind, where, what, seq)
    seq: int = 0
    synced_seq: int = 0

    def write_block(self, block: int, object_id: int) -> int:
        self.seq += 1
        self.pending.append(("block", block, object_id, self.seq))
        return self.seq

    def write_record(self, slot: int, data: bytes) -> int:
        self.seq += 1
        self.pending.append(("record", slot, data, self.seq))
        return self.seq

    def sync(self) -> None:
        for kind, where, what, _ in self.pending:
            if kind == "block":
                assert isinstance(what, int)
                self.blocks[where] = what
            else:
                assert isinstance(what, bytes)
                self.records[where] = what
        self.pending.clear()
        self.synced_seq = self.seq


class DiskMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.data_bytes = 16
        self.slots_max = 4
        self.t = DiskSlotTable(16, 4, block_bytes=1)
        self.disk = Disk()
        self.ops: dict[int, Op] = {}  # object id -> op, while it holds a slot
        self.ids = itertools.count(1)
        self.last_gen: dict[int, int] = {}  # slot -> last generation handed out
        self.crashes = 0
        self.began: set[tuple[int, int, bytes]] = set()  # every (slot, generation, checksum) committed

    @initialize(data_units=st.integers(4, 24), slots_max=st.sampled_from((2, 4, 8)))
    def setup(self, data_units: int, slots_max: int) -> None:
        self.data_bytes, self.slots_max = data_units, slots_max
        self.t = DiskSlotTable(data_units, slots_max, block_bytes=1)

    # ---- helpers -----------------------------------------------------------------------------

    def held_extents(self) -> list[tuple[int, int]]:
        return sorted((o.offset, o.extent) for o in self.ops.values() if o.extent)

    def holes(self) -> list[tuple[int, int]]:
        out, pos = [], 0
        for offset, extent in self.held_extents():
            if offset > pos:
                out.append((pos, offset - pos))
            pos = offset + extent
        if pos < self.data_bytes:
            out.append((pos, self.data_bytes - pos))
        return out

    def pick(self, data: st.DataObject, step: str) -> Op:
        return data.draw(st.sampled_from([o for _, o in sorted(self.ops.items()) if o.step == step]))

    def has(self, step: str) -> bool:
        return any(o.step == step for o in self.ops.values())

    def durable(self, seq: int) -> bool:
        return 0 <= seq <= self.disk.synced_seq

    # ---- the write protocol ------------------------------------------------------------------

    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        size = data.draw(st.integers(1, self.data_bytes + 1))
        fits = sorted((n, o) for o, n in self.holes() if n >= size)
        key = data.draw(st.binary(max_size=8))
        if size > self.data_bytes or len(self.ops) >= self.slots_max or not fits:
            used = self.t.used_bytes
            with pytest.raises(NoCapacity):
                self.t.alloc(size, key)
            assert self.t.used_bytes == used
            return
        a = self.t.alloc(size, key)
        assert a.slot not in {o.slot for o in self.ops.values()}, "slot id handed out twice"
        assert a.offset == fits[0][1], "not the best-fit hole"
        assert a.generation > self.last_gen.get(a.slot, 0) or self.crashes, "generation went back"
        self.last_gen[a.slot] = a.generation
        object_id = next(self.ids)
        self.ops[object_id] = Op(object_id, a.slot, a.generation, a.offset, size, a.extent_bytes, key)

    @rule(data=st.data())
    def store_object(self, data: st.DataObject) -> None:
        """The whole protocol at once (alloc, data, sync, commit record, sync, end_commit): so
        examples reach many stored objects, then free, reuse and crash among them."""
        before = set(self.ops)
        self.alloc(data)
        new = [o for i, o in self.ops.items() if i not in before]
        if not new:
            return
        op = new[0]
        self.write_data_of(op)
        self.disk.sync()
        self.commit_of(op)
        self.disk.sync()
        assert self.t.end_commit(op.slot, op.generation, durable=True) is None
        op.step = "stored"

    @precondition(lambda self: self.has("allocated"))
    @rule(data=st.data())
    def write_data(self, data: st.DataObject) -> None:
        self.write_data_of(self.pick(data, "allocated"))

    def write_data_of(self, op: Op) -> None:
        for block in range(op.offset, op.offset + op.extent):
            op.data_seq = self.disk.write_block(block, op.object_id)
        op.step = "written"

    @rule()
    def sync(self) -> None:
        self.disk.sync()

    @precondition(lambda self: self.has("written") or self.has("allocated"))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        op = self.pick(data, data.draw(st.sampled_from([s for s in ("allocated", "written") if self.has(s)])))
        self.t.abort(op.slot, op.generation)
        del self.ops[op.object_id]

    @precondition(
        lambda self: any(o.step == "written" and self.durable(o.data_seq) for o in self.ops.values())
    )
    @rule(data=st.data())
    def begin_commit(self, data: st.DataObject) -> None:
        ready = [o for _, o in sorted(self.ops.items()) if o.step == "written" and self.durable(o.data_seq)]
        self.commit_of(data.draw(st.sampled_from(ready)))

    def commit_of(self, op: Op) -> None:
        record = self.t.begin_commit(op.slot, op.generation, object_checksum(op.object_id))
        if op.fenced:
            assert record is None, "a freed write was committed"
            del self.ops[op.object_id]
            return
        assert record == Record(
            "commit", op.slot, op.generation, op.offset, op.size, object_checksum(op.object_id), op.key
        )
        op.record_seq = self.disk.write_record(op.slot, encode_record(record, FILE_ID))
        self.began.add((op.slot, op.generation, record.checksum))
        op.step = "committing"
        with pytest.raises(NotFound):  # nothing is readable before end_commit
            self.t.acquire(op.slot, op.generation, op.size)

    @precondition(lambda self: self.has("committing"))
    @rule(data=st.data(), io_error=st.booleans())
    def end_commit(self, data: st.DataObject, io_error: bool) -> None:
        op = self.pick(data, "committing")
        if not io_error and not self.durable(op.record_seq):
            self.disk.sync()
        record = self.t.end_commit(op.slot, op.generation, durable=not io_error)
        if not io_error and not op.fenced:
            assert record is None
            op.step = "stored"
            return
        assert record == Record("free", op.slot, op.generation + 1)
        self.start_unlink(op, record)

    def start_unlink(self, op: Op, record: Record) -> None:
        op.step = "unlinking"
        op.unlink_generation = record.generation
        op.free_seq = self.disk.write_record(op.slot, encode_record(record, FILE_ID))

    @precondition(
        lambda self: any(o.step == "unlinking" and self.durable(o.free_seq) for o in self.ops.values())
    )
    @rule(data=st.data())
    def unlinked(self, data: st.DataObject) -> None:
        ready = [o for _, o in sorted(self.ops.items()) if o.step == "unlinking" and self.durable(o.free_seq)]
        op = data.draw(st.sampled_from(ready))
        self.t.unlinked(op.slot, op.unlink_generation)
        op.step = "done"
        if op.readers == 0:
            del self.ops[op.object_id]

    # ---- frees and reads ---------------------------------------------------------------------

    @precondition(
        lambda self: any(
            o.step in ("allocated", "written", "committing", "stored") for o in self.ops.values()
        )
    )
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        live = [
            o
            for _, o in sorted(self.ops.items())
            if o.step in ("allocated", "written", "committing", "stored") and not o.fenced
        ]
        if not live:
            return
        op = data.draw(st.sampled_from(live))
        result = self.t.free(op.slot, op.generation)
        if op.step != "stored":
            assert result.result == "deferred" and result.record is None
            op.fenced = True
        else:
            assert result.record == Record("free", op.slot, op.generation + 1)
            assert result.result == ("deferred" if op.readers else "freed")
            self.start_unlink(op, result.record)
        with pytest.raises(StaleGeneration):
            self.t.acquire(op.slot, op.generation, op.size)
        again = self.t.free(op.slot, op.generation)
        assert again.result == "already_freed" and again.record is None

    @precondition(lambda self: any(o.step == "stored" for o in self.ops.values()))
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        op = self.pick(data, "stored")
        grant = self.t.acquire(op.slot, op.generation, op.size)
        assert (grant.offset, grant.size, grant.checksum) == (
            op.offset,
            op.size,
            object_checksum(op.object_id),
        )
        op.readers += 1

    @precondition(lambda self: any(o.readers for o in self.ops.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        op = data.draw(st.sampled_from([o for _, o in sorted(self.ops.items()) if o.readers]))
        self.t.release(op.slot, op.generation)
        op.readers -= 1
        if op.readers == 0 and op.step == "done":
            del self.ops[op.object_id]

    # ---- crash and recovery ------------------------------------------------------------------

    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """Power loss now: each write since the last sync landed or not, a record may be torn."""
        blocks = dict(self.disk.blocks)
        records = dict(self.disk.records)
        for kind, where, what, _ in self.disk.pending:
            fate = data.draw(
                st.sampled_from(("lost", "landed", TORN) if kind == "record" else ("lost", "landed"))
            )
            if fate == "lost":
                continue
            if kind == "block":
                assert isinstance(what, int)
                blocks[where] = what
            else:
                assert isinstance(what, bytes)
                records[where] = what if fate == "landed" else what[:100] + bytes(len(what) - 100)
        acknowledged = {
            op.slot: op
            for op in self.ops.values()
            if op.step == "stored"  # committed, never freed
        }
        decoded = [decode_record(records.get(s, bytes(512)), FILE_ID, s) for s in range(self.slots_max)]
        t, unlinks = DiskSlotTable.recover(self.data_bytes, decoded, block_bytes=1)
        t.check_invariants()
        held = {h.slot: h for h in t.held()}
        for h in held.values():
            grant = t.acquire(h.slot, h.generation, h.size)
            owner = int.from_bytes(grant.checksum, "big")
            torn = [
                b for b in range(grant.offset, grant.offset + grant.extent_bytes) if blocks.get(b) != owner
            ]
            assert not torn, f"recovered a torn object: slot {h.slot} blocks {torn}"
            assert (h.slot, h.generation, h.checksum) in self.began, (
                "recovered an object that never committed"
            )
            t.release(h.slot, h.generation)
        for slot, op in acknowledged.items():
            found = held.get(slot)
            assert found is not None, f"lost an acknowledged object in slot {slot}"
            assert (found.generation, found.size, found.checksum, found.key) == (
                op.generation,
                op.size,
                object_checksum(op.object_id),
                op.key,
            )
        # The shell writes and syncs the dropped records' free records before serving.
        for record in unlinks:
            records[record.slot] = encode_record(record, FILE_ID)
        for record in unlinks:
            t.unlinked(record.slot, record.generation)
        # The disk after the crash, fully synced; the machine goes on from the recovered table.
        self.disk = Disk(blocks=blocks, records=records)
        self.t = t
        self.crashes += 1
        self.ops = {}
        for h in t.held():
            grant = t.acquire(h.slot, h.generation, h.size)
            t.release(h.slot, h.generation)
            object_id = int.from_bytes(h.checksum, "big")
            op = Op(
                object_id,
                h.slot,
                h.generation,
                grant.offset,
                h.size,
                grant.extent_bytes,
                h.key,
                step="stored",
            )
            self.ops[object_id] = op
            self.last_gen[h.slot] = max(self.last_gen.get(h.slot, 0), h.generation)

    # ---- checks ------------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.t.check_invariants()
        assert self.t.used_bytes + self.t.free_bytes == self.data_bytes
        assert self.t.used_bytes == sum(o.extent for o in self.ops.values())
        assert self.t.objects == sum(1 for o in self.ops.values() if o.step == "stored")

    @invariant()
    def every_crash_recoverable(self) -> None:
        """Were the power lost now, whatever the disk kept: every commit record it could hold names
        bytes that are certainly its object's (synced, and no write of another object pending on
        them), no two such records overlap, and every acknowledged object's commit record is
        certainly there. (The `crash` rule then takes one of those outcomes and recovers from it.)"""
        pending_blocks: dict[int, set[int]] = {}
        possible: dict[int, list[bytes]] = {}
        for kind, where, what, _ in self.disk.pending:
            if kind == "block":
                assert isinstance(what, int)
                pending_blocks.setdefault(where, set()).add(what)
            else:
                assert isinstance(what, bytes)
                possible.setdefault(where, []).append(what)
        extents: list[tuple[int, int, int]] = []
        for slot in range(self.slots_max):
            candidates = possible.get(slot, []) + (
                [self.disk.records[slot]] if slot in self.disk.records else []
            )
            for raw in candidates:
                record = decode_record(raw, FILE_ID, slot)
                if record is None or record.kind != "commit":
                    continue
                owner = int.from_bytes(record.checksum, "big")
                for b in range(record.offset, record.offset + record.size):
                    assert self.disk.blocks.get(b) == owner and pending_blocks.get(b, {owner}) == {owner}, (
                        f"a crash now could recover a torn object: slot {slot} block {b}"
                    )
                extents.append((record.offset, record.offset + record.size, slot))
        extents.sort()
        for (_, end, slot), (start, _, other) in itertools.pairwise(extents):
            assert end <= start, (
                f"commit records of slots {slot} and {other} could both be on disk, overlapping"
            )
        for op in self.ops.values():
            if op.step == "stored":
                assert op.slot not in possible, f"a crash now could lose acknowledged slot {op.slot}"
                on_disk = decode_record(self.disk.records.get(op.slot, b""), FILE_ID, op.slot)
                assert on_disk is not None and on_disk.checksum == object_checksum(op.object_id)

    def teardown(self) -> None:
        """Let go of everything: the data region is one free extent again."""
        for op in list(self.ops.values()):
            while op.readers:
                self.t.release(op.slot, op.generation)
                op.readers -= 1
            if op.step in ("allocated", "written"):
                self.t.abort(op.slot, op.generation)
                continue
            if op.step == "committing":
                record = self.t.end_commit(op.slot, op.generation, durable=True)
                if record is not None:
                    self.t.unlinked(op.slot, record.generation)
                    continue
                op.step = "stored"
            if op.step == "stored":
                freed = self.t.free(op.slot, op.generation)
                assert freed.record is not None
                self.t.unlinked(op.slot, freed.record.generation)
            elif op.step == "unlinking":
                self.t.unlinked(op.slot, op.unlink_generation)
        self.t.check_invariants()
        assert self.t.used_bytes == 0
        assert self.t.free_extents() == [(0, self.data_bytes)]


DiskMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestDiskMachine = DiskMachine.TestCase

"""The slot table against a simple model, over random interleavings (Hypothesis).

Each example picks an arena (alignment 1, 16 or 64; 4..24 alignment units; 2..64 slot ids) and
then runs random orders of: `alloc` (small, any, exact-fit for a hole, larger than the arena),
`stored` of a write (or of a fenced one: answered `StaleGeneration`), `abort` (of a write, a
fenced write, an old generation), `acquire` (of a stored slot; of an old generation, a slot still
being written, a generation never handed out, a wrong size), `release`, `free` (of a write, a
stored object with or without readers, an old generation) and time passing with `expire_writes`.

The model: the live slots by id (generation, extent, state, readers, whether the writer still
holds the bytes), the last generation handed out per id and every generation freed. From it:
- `alloc` must pick the lowest unused slot id, a generation above any before it for that id, and
  the best-fit hole (smallest that fits, lowest offset) among the arena minus the live extents;
  NoCapacity exactly when no id or no hole is left. So an extent held by a reader or a writer is
  never handed out, and a missed coalesce shows up as a wrong hole or a wrong NoCapacity.
- an acquire of a freed or freeing generation must fail (`StaleGeneration`) and change nothing;
- after every step: `check_invariants()`, live extents disjoint and inside the arena, the free
  list equal to the model's holes, and used + free == arena.
Every example ends by letting go of everything (release, abort, free) and checking that the
arena is one free extent again with `used_bytes == 0`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfabric.core.segment_slots import SlotTable
from kvfabric.format.errors import BadRequest, NoCapacity, NotFound, StaleGeneration

TTLS_MS = (1, 20, 100)
STEPS_MS = (0, 1, 10, 50, 200)


@dataclass
class MSlot:
    slot: int
    generation: int
    offset: int
    size: int
    extent: int
    deadline_ms: int
    state: str = "writing"  # "writing" | "stored" | "freeing"
    readers: int = 0
    writer: bool = True

    @property
    def checksum(self) -> bytes:
        return f"{self.slot}:{self.generation}".encode()


def round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = SlotTable(64)
        self.arena = 64
        self.alignment = 64
        self.slots_max = 1
        self.now_ms = 0
        self.live: dict[int, MSlot] = {}
        self.last_gen: dict[int, int] = {}
        self.freed: list[tuple[int, int, int]] = []  # (slot, generation, size) of freed generations

    @initialize(
        alignment=st.sampled_from((1, 16, 64)),
        units=st.integers(4, 24),
        slots_max=st.sampled_from((2, 4, 8, 64)),
    )
    def setup(self, alignment: int, units: int, slots_max: int) -> None:
        self.alignment, self.arena, self.slots_max = alignment, units * alignment, slots_max
        self.t = SlotTable(self.arena, alignment=alignment, slots_max=slots_max)

    # ---- the model ---------------------------------------------------------------------------

    def holes(self) -> list[tuple[int, int]]:
        """The arena minus the live extents, as (offset, length)."""
        out, pos = [], 0
        for m in sorted(self.live.values(), key=lambda m: m.offset):
            if m.offset > pos:
                out.append((pos, m.offset - pos))
            pos = m.offset + m.extent
        if pos < self.arena:
            out.append((pos, self.arena - pos))
        return out

    def current(self, slot: int) -> int:
        m = self.live.get(slot)
        if m is not None and m.state != "freeing":
            return m.generation
        return self.last_gen[slot] + 1 if slot in self.last_gen else 0

    def fence(self, m: MSlot) -> None:
        """A free was accepted: the generation is old from now on."""
        m.state = "freeing"
        self.freed.append((m.slot, m.generation, m.size))

    def maybe_reclaim(self, m: MSlot) -> None:
        if m.state == "freeing" and m.readers == 0 and not m.writer:
            del self.live[m.slot]

    def pick(self, data: st.DataObject, cond: str) -> MSlot:
        return data.draw(st.sampled_from([m for _, m in sorted(self.live.items()) if self.has(m, cond)]))

    @staticmethod
    def has(m: MSlot, cond: str) -> bool:
        return {
            "writing": m.state == "writing",
            "fenced_write": m.state == "freeing" and m.writer,
            "stored": m.state == "stored",
            "read": m.readers > 0,
            "freeable": m.state != "freeing",
        }[cond]

    def any_live(self, cond: str) -> bool:
        return any(self.has(m, cond) for m in self.live.values())

    # ---- rules -------------------------------------------------------------------------------

    @rule(data=st.data(), ttl_ms=st.sampled_from(TTLS_MS))
    def alloc(self, data: st.DataObject, ttl_ms: int) -> None:
        holes = self.holes()
        sizes = [st.integers(1, max(1, self.arena // 4)), st.integers(1, self.arena + self.alignment)]
        if holes:  # sizes that round up to exactly a hole
            sizes.append(
                st.sampled_from([n for _, n in holes]).flatmap(
                    lambda n: st.integers(max(1, n - self.alignment + 1), n)
                )
            )
        size = data.draw(st.one_of(*sizes))
        extent = round_up(size, self.alignment)
        fits = sorted((n, o) for o, n in holes if n >= extent)
        if extent > self.arena or len(self.live) >= self.slots_max or not fits:
            used = self.t.used_bytes
            with pytest.raises(NoCapacity):
                self.t.alloc(size, self.now_ms, self.now_ms + ttl_ms)
            assert self.t.used_bytes == used
            return
        a = self.t.alloc(size, self.now_ms, self.now_ms + ttl_ms)
        # Never reuse a slot id or an extent someone holds; generations only grow.
        assert a.slot == min(set(range(self.slots_max)) - self.live.keys())
        assert a.slot not in self.live
        assert a.generation == self.last_gen.get(a.slot, 0) + 1
        assert a.offset % self.alignment == 0 and a.offset >= 0 and a.offset + extent <= self.arena
        for m in self.live.values():
            assert a.offset + extent <= m.offset or m.offset + m.extent <= a.offset, "overlap"
        assert a.offset == fits[0][1], "not the best-fit hole"
        assert a.size == size
        self.last_gen[a.slot] = a.generation
        self.live[a.slot] = MSlot(a.slot, a.generation, a.offset, size, extent, self.now_ms + ttl_ms)

    @precondition(lambda self: self.any_live("writing"))
    @rule(data=st.data())
    def stored(self, data: st.DataObject) -> None:
        m = self.pick(data, "writing")
        self.t.stored(m.slot, m.generation, m.checksum)
        m.state, m.writer = "stored", False

    @precondition(lambda self: self.any_live("fenced_write"))
    @rule(data=st.data())
    def stored_after_fence(self, data: st.DataObject) -> None:
        m = self.pick(data, "fenced_write")
        with pytest.raises(StaleGeneration):
            self.t.stored(m.slot, m.generation, m.checksum)
        m.writer = False
        self.maybe_reclaim(m)

    @precondition(lambda self: any(m.writer for m in self.live.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        held = [m for _, m in sorted(self.live.items()) if m.writer]  # writing or fenced_write
        m = data.draw(st.sampled_from(held))
        self.t.abort(m.slot, m.generation)
        if m.state == "writing":
            self.fence(m)
        m.writer = False
        self.maybe_reclaim(m)

    @precondition(lambda self: self.any_live("stored"))
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        m = self.pick(data, "stored")
        g = self.t.acquire(m.slot, m.generation, m.size)
        assert (g.slot, g.generation, g.offset, g.size, g.checksum) == (
            m.slot,
            m.generation,
            m.offset,
            m.size,
            m.checksum,
        )
        m.readers += 1

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def acquire_stale(self, data: st.DataObject) -> None:
        """No read of an old generation ever succeeds, and a rejected one changes nothing."""
        slot, generation, size = data.draw(st.sampled_from(self.freed))
        stale = self.t.counters.get("stale_generation_rejected_total", 0)
        used = self.t.used_bytes
        with pytest.raises(StaleGeneration) as err:
            self.t.acquire(slot, generation, size)
        assert err.value.details["current"] == self.current(slot) > generation
        assert self.t.counters["stale_generation_rejected_total"] == stale + 1
        assert self.t.used_bytes == used

    @precondition(lambda self: self.live)
    @rule(data=st.data(), how=st.sampled_from(("wrong_size", "future_generation", "writing")))
    def acquire_bad(self, data: st.DataObject, how: str) -> None:
        m = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda m: m.slot)))
        if how == "wrong_size" and m.state == "stored":
            with pytest.raises(BadRequest):
                self.t.acquire(m.slot, m.generation, m.size + 1)
        elif how == "writing" and m.state == "writing":
            with pytest.raises(NotFound):  # nothing is readable before `stored`
                self.t.acquire(m.slot, m.generation, m.size)
        else:
            with pytest.raises(NotFound):
                self.t.acquire(m.slot, self.current(m.slot) + 1, m.size)

    @precondition(lambda self: self.any_live("read"))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        m = self.pick(data, "read")
        self.t.release(m.slot, m.generation)
        m.readers -= 1
        self.maybe_reclaim(m)

    @precondition(lambda self: self.any_live("freeable"))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        m = self.pick(data, "freeable")
        expected = "freed" if m.readers == 0 and not m.writer else "deferred"
        assert self.t.free(m.slot, m.generation) == expected
        self.fence(m)
        self.maybe_reclaim(m)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def free_or_abort_old_generation(self, data: st.DataObject) -> None:
        """Retried frees are idempotent; an abort of a write already given up is a no-op."""
        slot, generation, _ = data.draw(st.sampled_from(self.freed))
        assert self.t.free(slot, generation) == "already_freed"
        m = self.live.get(slot)
        if m is None or m.generation != generation:  # not the fenced write itself
            self.t.abort(slot, generation)

    @rule(step_ms=st.sampled_from(STEPS_MS))
    def tick(self, step_ms: int) -> None:
        self.now_ms += step_ms
        due = sorted(s for s, m in self.live.items() if m.state == "writing" and m.deadline_ms <= self.now_ms)
        assert sorted(self.t.expire_writes(self.now_ms)) == due
        for s in due:
            self.fence(self.live[s])  # the transport still holds it: nothing is reclaimed yet

    # ---- after every step --------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        t = self.t
        t.check_invariants()
        live = sorted(self.live.values(), key=lambda m: m.offset)
        for a, b in itertools.pairwise(live):
            assert a.offset + a.extent <= b.offset, "live extents overlap"
        assert all(m.offset >= 0 and m.offset + m.extent <= self.arena for m in live)
        used = sum(m.extent for m in live)
        assert (t.used_bytes, t.free_bytes) == (used, self.arena - used)
        assert t.used_bytes + t.free_bytes == self.arena
        assert t.free_extents() == self.holes()
        assert t.largest_free_bytes == max((n for _, n in self.holes()), default=0)
        assert t.slots_in_use == len(self.live)
        assert t.deferred_frees == sum(m.state == "freeing" for m in live)
        assert t.writing == sum(m.state == "writing" for m in live)

    def teardown(self) -> None:
        """Let go of everything: no leak is left behind."""
        t = self.t
        for m in list(self.live.values()):
            for _ in range(m.readers):
                t.release(m.slot, m.generation)
            if m.writer:
                t.abort(m.slot, m.generation)
            if m.state == "stored":
                assert t.free(m.slot, m.generation) == "freed"
        t.check_invariants()
        assert (t.used_bytes, t.slots_in_use, t.deferred_frees, t.writing) == (0, 0, 0, 0)
        assert t.free_extents() == [(0, self.arena)]
        assert t.fragmentation == 0.0


SlotMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSlotMachine = SlotMachine.TestCase

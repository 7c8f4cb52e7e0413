"""The client load table against a simple model, over random interleavings (Hypothesis).

Random orders of: `want` (of 3 objects into 4 engine buffers; sometimes with an old generation,
answered `StaleGeneration`), `transfer_done` ok or failed, a late `transfer_done` (of a cancelled
transfer, or a duplicate/unknown one), the shell's copy (`may_write` then `delivered`) of a
pending Deliver, `cancel` (of a live or an ended load), and time passing with `expire`. The engine
reuses a buffer, with a newer generation, as soon as its load has ended.

The model keeps the live loads, the live transfers (one per object) with their waiters, the
cancelled ones, and every load's outcomes. Every call's effects must equal the model's exactly,
so a Deliver (or may_write == True) for an ended load, an old generation, or a second transfer for
an object fails the run. Every example ends by answering every transfer, copying every pending
Deliver and expiring everything: then each load has exactly one outcome, every StartTransfer
got exactly one ReleaseStaging, and the table is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfabric.core.client_loads import (
    Busy,
    CancelTransfer,
    Deliver,
    Effect,
    Fail,
    LoadTable,
    ReleaseStaging,
    StartTransfer,
    TransferId,
)
from kvfabric.format.errors import StaleGeneration
from kvfabric.format.generations import RequestGeneration as G

OBJECTS = (b"a", b"b", b"c")
DESTS = ("d0", "d1", "d2", "d3")
TRANSFERS_MAX = 2


@dataclass
class MLoad:
    gen: int
    dest: str
    tid: int
    deadline: int
    seq: int
    delivering: bool = False


@dataclass
class MTransfer:
    obj: bytes
    delivering: bool = False
    waiters: list[int] = field(default_factory=list)


class LoadTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = LoadTable(transfers_max=TRANSFERS_MAX)
        self.now = 0
        self.next_load = 0
        self.next_tid = 1
        self.dest_gen: dict[str, int] = {}
        self.live: dict[int, MLoad] = {}
        self.ended: dict[int, tuple[int, str]] = {}  # load -> (gen, dest), for the fence checks
        self.outcomes: dict[int, list[str]] = {}
        self.transfers: dict[int, MTransfer] = {}
        self.cancelled: set[int] = set()
        self.started: list[int] = []
        self.released: list[int] = []
        self.pending: list[Deliver] = []

    # ---- model helpers -------------------------------------------------------------------------

    def apply(self, effects: list[Effect], expected: list[Effect]) -> None:
        assert effects == expected
        for e in effects:
            if isinstance(e, StartTransfer):
                self.started.append(e.transfer_id)
            elif isinstance(e, ReleaseStaging):
                self.released.append(e.transfer_id)
            elif isinstance(e, Deliver):
                self.pending.append(e)

    def end(self, load: int, outcome: str, answered: bool = False) -> list[Effect]:
        m = self.live.pop(load)
        self.ended[load] = (m.gen, m.dest)
        self.outcomes[load].append(outcome)
        tr = self.transfers[m.tid]
        tr.waiters.remove(load)
        if tr.waiters:
            return []
        del self.transfers[m.tid]
        if not tr.delivering and not answered:
            self.cancelled.add(m.tid)
            return [CancelTransfer(TransferId(m.tid))]
        return [ReleaseStaging(TransferId(m.tid))]

    def held(self) -> int:
        return len(self.transfers) + len(self.cancelled)

    # ---- rules -----------------------------------------------------------------------------------

    @rule(
        obj=st.sampled_from(OBJECTS), dest=st.sampled_from(DESTS), ttl=st.integers(1, 60), stale=st.booleans()
    )
    def want(self, obj: bytes, dest: str, ttl: int, stale: bool) -> None:
        if any(m.dest == dest for m in self.live.values()):
            return  # the engine reuses a buffer only after its load ended
        load = self.next_load
        self.next_load += 1
        if stale and dest in self.dest_gen:
            gen = self.dest_gen[dest] - (self.next_load % 2)  # equal or older
            try:
                self.t.want(load, G(gen), obj, dest, now_ms=self.now, deadline_ms=self.now + ttl)
            except StaleGeneration:
                return
            raise AssertionError("old generation accepted")
        gen = self.dest_gen.get(dest, 0) + 1
        self.outcomes[load] = []
        live_tid = next((tid for tid, tr in self.transfers.items() if tr.obj == obj), None)
        expected: list[Effect] = []
        if live_tid is None:
            if self.held() >= TRANSFERS_MAX:
                self.outcomes[load].append("busy")
                self.apply(
                    self.t.want(load, G(gen), obj, dest, now_ms=self.now, deadline_ms=self.now + ttl),
                    [Busy(load, "transfers")],
                )
                return
            live_tid = self.next_tid
            self.next_tid += 1
            self.transfers[live_tid] = MTransfer(obj)
            expected.append(StartTransfer(TransferId(live_tid), obj, 0))
        tr = self.transfers[live_tid]
        tr.waiters.append(load)
        self.dest_gen[dest] = gen
        self.live[load] = MLoad(gen, dest, live_tid, self.now + ttl, load, delivering=tr.delivering)
        if tr.delivering:
            expected.append(Deliver(load, G(gen), dest, TransferId(live_tid)))
        effects = self.t.want(load, G(gen), obj, dest, now_ms=self.now, deadline_ms=self.now + ttl)
        self.apply(effects, expected)

    @rule(pick=st.integers(0, 10), ok=st.booleans(), cause=st.sampled_from(["segment_down", "checksum"]))
    def transfer_done(self, pick: int, ok: bool, cause: str) -> None:
        fetching = [tid for tid, tr in self.transfers.items() if not tr.delivering]
        if not fetching:
            return
        tid = fetching[pick % len(fetching)]
        tr = self.transfers[tid]
        expected: list[Effect] = []
        if ok:
            tr.delivering = True
            for load in tr.waiters:
                self.live[load].delivering = True
                expected.append(Deliver(load, G(self.live[load].gen), self.live[load].dest, TransferId(tid)))
        else:
            expected = [Fail(load, cause) for load in tr.waiters]
            for load in list(tr.waiters):
                expected += self.end(load, "failed", answered=True)
        self.apply(self.t.transfer_done(TransferId(tid), ok, cause), expected)

    @rule(pick=st.integers(0, 10), ok=st.booleans())
    def late_transfer_done(self, pick: int, ok: bool) -> None:
        if self.cancelled:
            tid = sorted(self.cancelled)[pick % len(self.cancelled)]
            self.cancelled.remove(tid)
            self.apply(self.t.transfer_done(TransferId(tid), ok), [ReleaseStaging(TransferId(tid))])
        else:
            answered = [tid for tid in range(1, self.next_tid + 1) if tid not in self.transfers]
            tid = answered[pick % len(answered)]  # released already, or never started
            self.apply(self.t.transfer_done(TransferId(tid), ok), [])

    @rule(pick=st.integers(0, 10))
    def copy(self, pick: int) -> None:
        if not self.pending:
            return
        d = self.pending.pop(pick % len(self.pending))
        assert isinstance(d.load_id, int)
        m = self.live.get(d.load_id)
        allowed = m is not None and m.delivering and G(m.gen) == d.generation and m.dest == d.dest_id
        assert self.t.may_write(d.load_id, d.generation, d.dest_id) == allowed
        if allowed:
            self.apply(self.t.delivered(d.load_id, d.generation, d.dest_id), self.end(d.load_id, "delivered"))

    @rule(pick=st.integers(0, 100))
    def cancel(self, pick: int) -> None:
        if not self.outcomes:
            return
        load = pick % self.next_load
        expected = self.end(load, "cancelled") if load in self.live else []
        self.apply(self.t.cancel(load), expected)

    @rule(dest=st.sampled_from(DESTS))
    def forget_dest(self, dest: str) -> None:
        """An anonymous buffer is forgotten after its load: allowed only when no waiter holds it."""
        held = any(m.dest == dest for m in self.live.values())
        self.t.forget_dest(dest)
        if not held:
            self.dest_gen.pop(dest, None)

    @rule(step=st.sampled_from([0, 1, 10, 30]))
    def expire(self, step: int) -> None:
        self.now += step
        due = sorted((m.deadline, m.seq, load) for load, m in self.live.items() if m.deadline <= self.now)
        expected: list[Effect] = []
        for _, _, load in due:
            expected.append(Fail(load, "timeout"))
            expected += self.end(load, "timeout")
        self.apply(self.t.expire(self.now), expected)

    # ---- checks ----------------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.t.check_invariants()
        assert self.t.waiters_live == len(self.live)
        assert self.t.transfers_held == self.held() <= TRANSFERS_MAX
        objs = [tr.obj for tr in self.transfers.values()]
        assert len(objs) == len(set(objs))  # one transfer per object
        assert all(len(o) <= 1 for o in self.outcomes.values())
        for load, (gen, dest) in self.ended.items():
            assert not self.t.may_write(load, G(gen), dest)
        for load, m in self.live.items():
            assert self.t.may_write(load, G(m.gen), m.dest) == m.delivering
            assert not self.t.may_write(load, G(m.gen - 1), m.dest)

    def teardown(self) -> None:
        while any(not tr.delivering for tr in self.transfers.values()):
            self.transfer_done(0, ok=True, cause="")
        while self.pending:
            self.copy(0)
        while self.cancelled:
            self.late_transfer_done(0, ok=False)
        self.expire(10**6)
        self.consistent()
        assert not self.live and not self.transfers
        assert all(len(o) == 1 for o in self.outcomes.values()), self.outcomes
        assert sorted(self.started) == sorted(self.released) and len(set(self.released)) == len(self.released)
        assert self.t.transfers_held == 0 and self.t.held_bytes == 0


TestLoadTableMachine = LoadTableMachine.TestCase
TestLoadTableMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

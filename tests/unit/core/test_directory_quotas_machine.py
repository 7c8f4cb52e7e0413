"""Hypothesis: tenant usage stays exact and quotas hold over random put / confirm / commit /
abort / evict / free / segment restart / deadline interleavings of two tenants.

`check_invariants()` recomputes every tenant's bytes and objects from the directory's records
after each step (drift fails); the model checks the quota bounds and that a tenant holding
nothing has no usage left once every write deadline passed and every free was acknowledged."""

from __future__ import annotations

import contextlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfabric.core.directory import DirectoryConfig, DirectoryCore, Effect, FreeSlots
from kvfabric.core.quotas import TenantQuota, tenant_of
from kvfabric.format.errors import KvfError
from kvfabric.proto import directory as m

from .dirkit import SECRET, confirm_all, groups, key, register, spec
from .test_directory_quotas import A, groups_b

SIZE = 100
BYTES_MAX = 5 * SIZE
OBJECTS_MAX = 4
SEGMENTS = ("s1", "s2")
GROUPS = [*groups(6), *groups_b(6)]
KEYS = [key(g) for g in GROUPS]


class QuotaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        quota = TenantQuota(bytes_max=BYTES_MAX, objects_max=OBJECTS_MAX)
        self.core = DirectoryCore(
            DirectoryConfig(ticket_secret=SECRET, replicas_default=2, tenant_quotas={A: quota})
        )
        self.now = 0
        self.incarnation = dict.fromkeys(SEGMENTS, 1)
        for seg in SEGMENTS:
            register(self.core, seg)
        self.begun: dict[int, m.PutBeginReply] = {}
        self.frees: list[FreeSlots] = []
        self.requests = 0

    def _step(self, request: object) -> object:
        self.requests += 1
        try:
            outcome = self.core.handle(request, self.now)  # type: ignore[arg-type]
        except KvfError:
            return None
        self._effects(outcome.effects)
        return outcome.reply

    def _effects(self, effects: list[Effect]) -> None:
        self.frees.extend(e for e in effects if isinstance(e, FreeSlots))

    @rule(picks=st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=4, unique=True))
    def begin(self, picks: list[int]) -> None:
        reply = self._step(
            m.PutBegin(
                writer_id="w", request_id=f"b{self.requests}", objects=[spec(KEYS[i], SIZE) for i in picks]
            )
        )
        if isinstance(reply, m.PutBeginReply):
            for i, result in zip(picks, reply.results, strict=True):
                if result.status == "placed":
                    self.begun[i] = m.PutBeginReply(epoch=reply.epoch, results=[result])

    @precondition(lambda self: self.begun)
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.begun)))
        self.requests += 1
        with contextlib.suppress(KvfError):  # a ticket of a restarted segment: stale
            confirm_all(self.core, self.begun[i], self.now, slot_base=self.requests * 8)

    @precondition(lambda self: self.begun)
    @rule(data=st.data(), abort=st.booleans())
    def finish(self, data: st.DataObject, abort: bool) -> None:
        i = data.draw(st.sampled_from(sorted(self.begun)))
        kind = m.PutAbort if abort else m.PutCommit
        self._step(kind(writer_id="w", request_id=f"f{self.requests}", keys=[KEYS[i]]))
        del self.begun[i]

    @rule(i=st.integers(0, len(GROUPS) - 1))
    def evict(self, i: int) -> None:
        self._step(m.Evict(groups=[GROUPS[i].group_id()]))

    @precondition(lambda self: self.frees)
    @rule(n=st.integers(1, 4))
    def segments_free(self, n: int) -> None:
        for free in self.frees[:n]:
            self._step(
                m.SlotsFreed(segment_id=free.segment_id, incarnation=free.incarnation, freed=list(free.slots))
            )
        del self.frees[:n]

    @rule(seg=st.sampled_from(SEGMENTS))
    def segment_restarts(self, seg: str) -> None:
        self.incarnation[seg] += 1
        self._effects(register(self.core, seg, now=self.now, incarnation=self.incarnation[seg]).effects)

    @rule(ms=st.sampled_from([10, 1_000, 31_000]))
    def time_passes(self, ms: int) -> None:
        self.now += ms
        for seg in SEGMENTS:
            self._step(m.Heartbeat(segment_id=seg, incarnation=self.incarnation[seg], used_bytes=0))
        self._effects(self.core.tick(self.now))

    @invariant()
    def usage_is_exact_and_within_quota(self) -> None:
        self.core.check_invariants()  # recomputes every tenant's usage from the records
        use = self.core.quotas.usage.get(tenant_of(bytes(4) + A))
        if use is not None:
            assert use.objects <= OBJECTS_MAX
            # Frees not yet acknowledged still count, so only placements are bounded at begin;
            # what is held can never exceed the quota plus nothing: no rule adds extra copies.
            assert use.bytes <= BYTES_MAX

    def teardown(self) -> None:
        # Writers gone, every free acknowledged, everything evicted: nothing is held.
        self.now += 10 * 60_000
        for seg in SEGMENTS:
            self._step(m.Heartbeat(segment_id=seg, incarnation=self.incarnation[seg], used_bytes=0))
        self._effects(self.core.tick(self.now))
        self._step(m.Evict(groups=[g.group_id() for g in GROUPS]))
        for _ in range(3):
            frees, self.frees = self.frees, []
            for free in frees:
                self._step(
                    m.SlotsFreed(
                        segment_id=free.segment_id, incarnation=free.incarnation, freed=list(free.slots)
                    )
                )
        self.core.check_invariants()
        assert self.core.quotas.usage == {}


QuotaMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestQuotaMachine = QuotaMachine.TestCase

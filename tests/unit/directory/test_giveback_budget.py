"""A tenant's give-backs (issue 21, review of fair admission): never refused for load, but the
ids of theirs that released nothing are charged to a per-tenant budget (`GivebackBudget`); once
it is spent a give-back runs `GIVEBACK_SLICE_IDS` ids first and is `busy` when those released
nothing. A flood of empty 4,096-key aborts is refused after its budget, costing the core 64 keys
a request, while the same tenant's real releases and aborts still succeed."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, cast

import msgspec
import pytest

from kvfabric.core import authz
from kvfabric.core.directory import DirectoryCore
from kvfabric.directory.admission import AdmissionConfig, GivebackBudget
from kvfabric.directory.fair import FairGate
from kvfabric.directory.giveback import GIVEBACK_SLICE_IDS
from kvfabric.directory.metrics import DirectoryCollector
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.shell import DirectoryShell
from kvfabric.format.errors import Busy, NotFound
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.runtime.service import TenantHandler
from tests.unit.core.dirkit import DOMAIN, groups, key, new_core, put, register, spec

BURST_IDS = 2 * 4_096  # two max-size empty aborts


class _Runtime:
    def __init__(self, host: ShardHost) -> None:
        self.tenant: dict[str, TenantHandler] = {}
        self.host = host

    def add_endpoint(self, verb: str, handler: object, **_: object) -> str:
        return verb

    def add_tenant_endpoint(self, verb: str, handler: TenantHandler, **_: object) -> str:
        self.tenant[verb] = handler
        return verb


class _Counting:
    """Wraps the core's `handle` and `steps` (an abort of more than `WRITE_WHOLE_IDS_MAX`
    keys runs in steps of `WRITE_SLICE_IDS`): the ids of each give-back the core saw."""

    def __init__(self, core: DirectoryCore) -> None:
        self.seen: list[int] = []
        inner, inner_steps = core.handle, core.steps

        def handle(message: msgspec.Struct, now_ms: int, **kw: Any) -> Any:
            if isinstance(message, m.PutAbort):
                self.seen.append(len(message.keys))
            return inner(message, now_ms, **kw)

        def steps(message: msgspec.Struct, now_ms: int, ids_max: int) -> Any:
            if isinstance(message, m.PutAbort):
                self.seen.append(len(message.keys))
            return inner_steps(message, now_ms, ids_max)

        core.handle = handle  # type: ignore[method-assign,assignment]
        core.steps = steps  # type: ignore[method-assign,assignment]


def test_budget_charges_only_what_released_nothing() -> None:
    budget = GivebackBudget(ids_per_s=10.0, burst_ids=100)
    assert not budget.spent("bob", 0.0)
    budget.charge("bob", 0, 0.0)  # everything released: nothing charged, no state kept
    assert budget.tokens("bob", 0.0) == 100
    budget.charge("bob", 100, 0.0)
    assert budget.spent("bob", 0.0) and not budget.spent("alice", 0.0)
    assert budget.retry_after_s("bob", 0.0) == pytest.approx(0.1)
    assert not budget.spent("bob", 0.1)
    assert not budget.spent("bob", 10.0) and budget.tokens("bob", 10.0) == 100  # full: forgotten
    budget.check()


def _gate(now: list[float], empty_ids_per_s: float, burst_ids: int) -> FairGate:
    config = AdmissionConfig(
        ids_per_s=1_000,
        burst_ids=8_192,
        queue_max=4,
        running_max=4,
        tenant_running_max=1,
        giveback_empty_ids_per_s=empty_ids_per_s,
        giveback_empty_burst_ids=burst_ids,
    )
    return FairGate(config, clock=lambda: now[0])


def _host(core: DirectoryCore, gate: FairGate) -> _Runtime:
    """Bob's tenant endpoints of a host leading shard 0 with `core` (its shell never started:
    no NATS; nothing here frees a slot)."""
    host = ShardHost(
        "dir-a",
        1,
        core.config,
        registry=cast(Any, None),
        make_shell=cast(Any, None),
        grants={"bob": authz.TenantGrant("bob", frozenset({DOMAIN.digest()}))},
        fair=gate,
    )
    shell = DirectoryShell(
        core, tick_ms=100, events_outbox_max=10_000, events_max_age_s=60, free_timeout_s=1.0
    )
    host.shells[0] = shell
    runtime = _Runtime(host)
    host.attach(cast(Any, runtime))
    return runtime


def test_a_flood_of_empty_aborts_is_refused_while_real_give_backs_succeed() -> None:
    core = new_core()
    register(core, "s1", capacity=10**9)
    owned = [key(g) for g in groups(8, seed=1)]
    put(core, owned[:4], writer=authz.scoped_name("bob", "w"))
    hit = core.handle(
        m.Lookup(holder_id=authz.scoped_name("bob", "h"), groups=[g.group_id() for g in groups(4, seed=1)]), 0
    ).reply
    assert isinstance(hit, m.LookupReply) and hit.lease_id
    leases = [
        cast(
            m.LookupReply, core.handle(m.Lookup(holder_id=authz.scoped_name("bob", "h"), groups=[g]), 0).reply
        )
        for g in [groups(1, seed=1)[0].group_id()] * 2
    ]
    begun = core.handle(
        m.PutBegin(
            writer_id=authz.scoped_name("bob", "w"), request_id="b2", objects=[spec(k) for k in owned[4:]]
        ),
        0,
    ).reply
    assert isinstance(begun, m.PutBeginReply)
    counting = _Counting(core)
    now = [0.0]
    gate = _gate(now, 1.0, BURST_IDS)
    runtime = _host(core, gate)
    nothing = [key(g) for g in groups(4_096, seed=2)]  # bob's own domain, never written

    async def ask(verb: str, message: msgspec.Struct) -> msgspec.Struct:
        return await runtime.tenant[verb](encode(message), {}, "bob")

    async def scenario() -> None:
        async def empty_aborts(n: int) -> list[str]:
            answers = []
            for i in range(n):
                try:
                    reply = await ask(
                        "put_abort", m.PutAbort(writer_id="w", request_id=f"f{i}", keys=nothing)
                    )
                except Busy:
                    answers.append("busy")
                else:
                    assert isinstance(reply, m.PutAbortReply) and reply.aborted == 0
                    answers.append("served")
            return answers

        assert await empty_aborts(2) == ["served", "served"]  # the budget (8,192 ids) spent
        assert counting.seen == [4_096, 4_096]
        # spent, not refusing: a real release, release_many and abort succeed (slice first)
        released = await ask("lease_release", m.LeaseRelease(holder_id="h", lease_id=hit.lease_id))
        assert isinstance(released, m.LeaseReply) and released.lease_id == hit.lease_id
        many = m.LeaseReleaseMany(
            holder_id="h", parts=[m.ReleasePart(shard=0, lease_ids=[leases[0].lease_id])]
        )
        reply = await ask("lease_release_many", many)
        assert isinstance(reply, m.LeaseReleaseManyReply) and reply.parts[0].released == [leases[0].lease_id]
        abort = m.PutAbort(writer_id="w", request_id="real", keys=[*owned[4:], *nothing[:200]])
        aborted = await ask("put_abort", abort)
        assert isinstance(aborted, m.PutAbortReply) and aborted.aborted == 4
        # the next slice released nothing: the other 76 were not run (one real key in front of
        # thousands of empty ones is no way past the budget)
        assert counting.seen[-2:] == [GIVEBACK_SLICE_IDS, GIVEBACK_SLICE_IDS]
        assert gate.giveback.tokens("bob", now[0]) == -(200 - 76)  # a debt: 124 ids named nothing
        # a give-back of nothing while spent: busy after one slice, then busy before decoding
        seen = len(counting.seen)
        assert await empty_aborts(4) == ["busy"] * 4
        assert counting.seen[seen:] == [GIVEBACK_SLICE_IDS]  # one slice, then none decoded
        assert gate.giveback.refused_total == 1 and gate.giveback.refused_early_total == 3
        with pytest.raises(Busy) as refused:  # a single release of nothing: busy, before decoding
            await ask("lease_release", m.LeaseRelease(holder_id="h", lease_id=999_999))
        assert refused.value.details["retry_after_ms"] == (124 + 64 + 1) * 1000  # the debt refills
        with pytest.raises(Busy):  # a refusing tenant's real release too: its client retries busy
            await ask("lease_release", m.LeaseRelease(holder_id="h", lease_id=leases[1].lease_id))
        assert len(counting.seen) == seen + 1
        now[0] += 124 + 64 + 1  # a token back: the next give-back runs whole again
        released = await ask("lease_release", m.LeaseRelease(holder_id="h", lease_id=leases[1].lease_id))
        assert isinstance(released, m.LeaseReply)
        assert await empty_aborts(2) == ["served", "busy"]  # whole (a debt of 4,095), then a slice
        assert counting.seen[-2:] == [4_096, GIVEBACK_SLICE_IDS]
        now[0] += 4_096 + 64 + BURST_IDS  # the budget refilled
        with pytest.raises(NotFound):  # with budget left, a release of nothing answers as before
            await ask("lease_release", m.LeaseRelease(holder_id="h", lease_id=999_999))
        gate.giveback.check()
        metrics = {f.name: f for f in DirectoryCollector(runtime.host).collect()}
        counted = metrics["kvfabric_directory_giveback_refused"].samples[0].value
        assert counted == 1 + 3 + 2 + 1  # after a slice, and before decoding

    asyncio.run(asyncio.wait_for(scenario(), 10))
    gate.giveback.check()


def measure(requests: int = 20) -> dict[str, float]:
    """Bob's empty 4,096-key aborts through the host, CPU ms a request: with budget left (each
    runs whole), spent (its first one runs a slice, then `busy`), and refusing (`busy` before
    decoding; the hold before the answer is not CPU). And encoding + decoding one such abort.
    `python -m tests.unit.directory.test_giveback_budget`."""
    import time

    nothing = [key(g) for g in groups(4_096, seed=2)]
    abort = encode(m.PutAbort(writer_id="w", request_id="f", keys=nothing))
    cpu_ms: dict[str, list[float]] = {"budget_left_ms": [], "spent_slice_ms": [], "refused_early_ms": []}

    async def one(runtime: _Runtime, gate: FairGate) -> str:
        refusing = gate.giveback.refuses("bob", gate.clock())
        spent = gate.giveback.spent("bob", gate.clock())
        began = time.process_time()
        with contextlib.suppress(Busy):
            await runtime.tenant["put_abort"](abort, {}, "bob")
        label = "refused_early_ms" if refusing else "spent_slice_ms" if spent else "budget_left_ms"
        cpu_ms[label].append((time.process_time() - began) * 1000)
        return label

    for burst_ids in (10**9, 1):
        core = new_core()
        register(core, "s1", capacity=10**9)
        now = [0.0]
        gate = _gate(now, 1.0, burst_ids)
        runtime = _host(core, gate)
        for _ in range(requests):
            asyncio.run(one(runtime, gate))
    decode_began = time.process_time()
    for _ in range(requests):
        m.request_decoder.decode(encode(m.PutAbort(writer_id="w", request_id="f", keys=nothing)))
    figures = {k: round(sum(v) / len(v), 2) for k, v in cpu_ms.items() if v}
    figures["encode_decode_ms"] = round((time.process_time() - decode_began) * 1000 / requests, 2)
    return figures


if __name__ == "__main__":
    print(measure())

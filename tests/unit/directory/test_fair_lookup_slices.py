"""Issue 21 row 2, at the directory shell without NATS: what another tenant's long lookup, run in
slices, costs a request that arrives meanwhile.

- A request passes several event-loop iterations in the directory before its reply is on the
  wire (the socket's read callback, nats-py's read loop, the subscription's task, the handler's
  task, nats-py's flusher: `REQUEST_STAGES`). A lookup that yielded once between its slices was
  ready again in each of those iterations, so such a request waited about one slice per stage
  (`kvfabric.directory.shell.LOOKUP_SLICE_YIELDS`).
- A sliced lookup's reply objects are encoded as they are folded (`msgspec.Raw`): the cyclic GC
  has nothing of them to walk. As Structs, a 4,096-group hit kept ~12,000 tracked objects alive
  until its reply was sent, and every young collection meanwhile walked them.

`python -m tests.unit.directory.test_fair_lookup_slices [lookups]` measures the GC pauses of
4,096-group sliced lookups in this process (the service GC policy); docs/security.md quotes it
for this checkout and an older tree (`PYTHONPATH=<tree>/services/directory/src:.`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time

from kvfabric.directory import shell as directory_shell
from kvfabric.directory.shell import LOOKUP_SLICE_GROUPS, LOOKUP_SLICE_YIELDS
from kvfabric.directory.stalls import CORE_CALLS
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.runtime import gcpolicy
from tests.unit.directory.test_shell_side_channels import ALICE, ids, new_core, publish, shell_of

REQUEST_STAGES = 5  # event-loop iterations a request takes in the directory (module docstring)
GROUPS = 1_000


async def in_progress(delay_iterations: int) -> int:
    """A request arriving `delay_iterations` loop iterations from now and then passing
    `REQUEST_STAGES` iterations: how many core calls (the lookup's slices) ran meanwhile."""
    for _ in range(delay_iterations):
        await asyncio.sleep(0)
    began = CORE_CALLS.count
    for _ in range(REQUEST_STAGES):
        await asyncio.sleep(0)
    return CORE_CALLS.count - began


def test_a_request_in_progress_waits_for_one_slice_of_a_long_lookup_not_one_per_stage() -> None:
    """Requests arriving at every point of a 1,000-group lookup (8 slices): each one sees at
    most one slice run before it is through its stages (with one yield between slices: 4, one
    for each stage but the first); the lookup still hits whole, in as many core calls."""
    core = new_core()
    groups = ids(ALICE, GROUPS, seed=7)
    publish(core, groups)
    shell = shell_of(core)
    slices = -(-GROUPS // LOOKUP_SLICE_GROUPS)
    lookup = m.Lookup(holder_id="h", groups=groups)

    async def go(delay_iterations: int) -> int:
        before = CORE_CALLS.count
        looking = asyncio.create_task(shell.handle(lookup))
        other = asyncio.create_task(in_progress(delay_iterations))
        reply = await looking
        waited = await other
        assert isinstance(reply, m.LookupReply) and reply.hit_chunks == GROUPS
        assert CORE_CALLS.count - before == slices  # the same work, in as many core calls
        await shell.handle(m.LeaseRelease(holder_id="h", lease_id=reply.lease_id))
        return waited

    waits = [asyncio.run(go(delay)) for delay in range(0, slices * (LOOKUP_SLICE_YIELDS + 1))]
    assert max(waits) <= 1, waits
    core.check_invariants()


def test_a_sliced_lookups_reply_keeps_nothing_for_the_gc_and_sends_the_same_bytes() -> None:
    """A 1,000-group hit: no object of its reply is tracked by the cyclic GC (before: every
    `ObjectLocation` was), and its bytes decode to the objects the core folded in one call
    (tokens aside, which depend on the time), encoding back to the same bytes."""
    core = new_core()
    groups = ids(ALICE, GROUPS, seed=8)
    publish(core, groups)
    shell = shell_of(core)
    reply = asyncio.run(shell.handle(m.Lookup(holder_id="h", groups=groups)))
    assert isinstance(reply, m.LookupReply) and reply.hit_chunks == GROUPS
    assert not [o for o in reply.objects if gc.is_tracked(o)]
    data = encode(reply)
    decoded = m.reply_decoder.decode(data)
    assert isinstance(decoded, m.LookupReply) and encode(decoded) == data
    whole = core.handle(m.Lookup(holder_id="h2", groups=groups), 0).reply
    assert isinstance(whole, m.LookupReply) and whole.hit_chunks == GROUPS

    def placed(objects: list[m.ObjectLocation]) -> list[tuple[object, ...]]:
        return [
            (o.chunk_index, o.member, o.checksum, [(r.segment_id, r.slot) for r in o.replicas])
            for o in objects
        ]

    assert placed(decoded.objects) == placed(whole.objects)
    core.check_invariants()


def gc_pauses_of_sliced_lookups(lookups: int, groups: int = 4_096) -> dict[str, object]:
    """`lookups` sliced hits of `groups` groups each (lease released), this process under the
    service GC policy (frozen after setup): each generation's collections, their total and
    longest ms, and the CPU ms a lookup took (GC included)."""
    core = new_core()
    wanted = ids(ALICE, groups, seed=9)
    publish(core, wanted)
    shell = shell_of(core)
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    async def run() -> int:
        size = 0
        for _ in range(lookups):
            reply = await shell.handle(m.Lookup(holder_id="h", groups=wanted))
            assert isinstance(reply, m.LookupReply)
            size = len(encode(reply))  # as the runtime sends it
            await shell.handle(m.LeaseRelease(holder_id="h", lease_id=reply.lease_id))
        return size

    gcpolicy.install()
    gcpolicy.freeze_long_lived("measurement")
    gc.callbacks.append(timed)
    try:
        began = time.process_time()
        size = asyncio.run(run())
        cpu_s = time.process_time() - began
    finally:
        gc.callbacks.remove(timed)
        gcpolicy.uninstall()
    return {
        "shell": directory_shell.__file__,
        "lookups": lookups,
        "reply_bytes": size,
        "cpu_ms_per_lookup": round(cpu_s * 1e3 / lookups, 1),
        **{
            f"gen{g}_n_ms_longest_ms": [len(p), round(sum(p) * 1e3, 1), round(max(p, default=0) * 1e3, 2)]
            for g, p in pauses.items()
        },
    }


if __name__ == "__main__":
    print(json.dumps(gc_pauses_of_sliced_lookups(int(sys.argv[1]) if len(sys.argv) > 1 else 40)))

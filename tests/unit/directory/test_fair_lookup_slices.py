"""Issue 21 row 2, at the directory shell without NATS: a request in progress while another
tenant's long lookup runs in slices waits for one slice, not for one slice per stage it passes.

A request passes several event-loop iterations in the directory before its reply is on the wire
(the socket's read callback, nats-py's read loop, the subscription's task, the handler's task,
nats-py's flusher: `REQUEST_STAGES`). A lookup that yielded once between its slices was ready
again in each of those iterations, so such a request waited about one slice per stage
(`handlers.LOOKUP_SLICE_YIELDS`, docs/security.md).
"""

from __future__ import annotations

import asyncio

from kvfabric.directory.handlers import LOOKUP_SLICE_GROUPS, LOOKUP_SLICE_YIELDS
from kvfabric.directory.stalls import CORE_CALLS
from kvfabric.proto import directory as m
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

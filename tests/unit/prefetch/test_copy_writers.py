"""Copies of one object to two targets at once (two engine hosts' hints) do not abort each other:
the directory aborts a writer's tickets by key, and prefetch named one writer for every copy, so
the failed copy's abort took the other's ticket and that copy failed too (review, 2026-12-06).
Each copy now names its target's writer (`copy_writer_id`): the core runs at most one copy per
(object, target)."""

from __future__ import annotations

import asyncio

from kvfabric.core.prefetch import StartCopy
from kvfabric.format.errors import Unavailable
from tests.unit.prefetch.test_shell_shards import make_shell
from tests.unit.repair.test_copy_cancel import SEGMENTS, SIZE, MakeCluster, cluster, settle

__all__ = ["cluster"]  # the fixture, used by name


async def test_a_failed_copy_does_not_abort_a_copy_of_the_same_object_to_another_target(
    cluster: MakeCluster,
) -> None:
    c, k = cluster(2)
    holders = c.holders(k)
    here, there = (s for s in SEGMENTS if s not in holders)
    shell = make_shell(c)  # type: ignore[arg-type]
    copies = [
        asyncio.create_task(shell._copy(StartCopy(i, bytes(k), holders[0], target, SIZE, False)))
        for i, target in enumerate((here, there), start=1)
    ]
    await settle()
    failing, landing = c.jobs  # each copy reached its destination segment
    assert (failing.ticket.segment_id, landing.ticket.segment_id) == (here, there)
    failing.gate.set_exception(Unavailable(f"{here} went away"))  # its abort runs now
    await settle()
    landing.gate.set_result(None)
    await settle()
    await asyncio.gather(*copies)
    assert there in c.holders(k), "the failed copy's abort took the other copy's ticket"
    assert here not in c.holders(k) and c.aborted == 1

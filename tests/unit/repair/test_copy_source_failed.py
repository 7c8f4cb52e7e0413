"""The repair shell tells the core which copy failures were the source's (issue 27 clock-skew
drill): the destination's error carries `source_addr` when reading the source failed (copier),
and then the next copy of that object reads another replica."""

from __future__ import annotations

from kvfabric.core.repair import RepairConfig, RepairCore, StartCopy
from kvfabric.format.errors import Busy, ChecksumMismatch, NotFound, Unauthorized
from kvfabric.repair.shell import RepairShell, now_ms

MB = 1 << 20


def shell_with_object() -> tuple[RepairShell, RepairCore]:
    core = RepairCore(RepairConfig(retry_backoff_ms=0))
    for segment_id, zone in (("a", "z1"), ("b", "z2"), ("c", "z3"), ("d", "z4")):
        core.segment_up(segment_id, incarnation=1, zone=zone, rack="r", host="h", free_bytes=100 * MB)
    core.object_known(b"o" * 96, size_bytes=MB, replica_target=3, segments=["a", "b"])
    shell = RepairShell(
        core, replicas_target=3, scan_ms=1000, tick_ms=100, request_timeout_s=1.0, copy_timeout_s=1.0
    )
    return shell, core


async def copy_failing_with(shell: RepairShell, core: RepairCore, error: Exception) -> tuple[str, str]:
    """Run one planned copy that fails with `error`; (its source, the next copy's source)."""
    (first,) = core.tick(now_ms())
    assert isinstance(first, StartCopy)

    async def failing(start: StartCopy) -> bool:
        raise error

    shell._copy_once = failing  # type: ignore[method-assign]
    await shell._copy(first)
    (second,) = core.tick(now_ms())
    assert isinstance(second, StartCopy)
    return first.source, second.source


async def test_a_copy_the_source_refused_is_retried_from_another_replica() -> None:
    shell, core = shell_with_object()
    refused = Unauthorized("a data connection must first present a valid read token", source_addr="tcp://x:1")
    first, second = await copy_failing_with(shell, core, refused)
    assert second != first and core.counters["copies_source_failed_total"] == 1


async def test_a_copy_that_failed_at_the_destination_keeps_its_source() -> None:
    shell, core = shell_with_object()
    first, second = await copy_failing_with(shell, core, NotFound("no such ticket"))
    assert second == first and "copies_source_failed_total" not in core.counters


async def test_a_checksum_mismatch_at_the_destination_reads_another_replica_next() -> None:
    """The bytes the destination got were not the object's: the source's fault (or its path).
    The same source was picked every time, and a drain whose other replica was good never
    ended (review, stop 70)."""
    shell, core = shell_with_object()
    first, second = await copy_failing_with(shell, core, ChecksumMismatch("bytes differ"))
    assert second != first and core.counters["copies_source_failed_total"] == 1


async def test_a_busy_source_is_a_source_failure_not_a_busy_destination() -> None:
    shell, core = shell_with_object()
    first, second = await copy_failing_with(shell, core, Busy("source busy", source_addr="tcp://x:1"))
    assert second != first and core.counters["copies_source_failed_total"] == 1

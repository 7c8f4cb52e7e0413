"""Metrics collectors run in the metrics server's thread while the event loop changes the cores.
A collector that walks a live dict in Python (a comprehension, `Counter.update(d)`, even
`list(d.items())`, whose item tuples can start the cyclic GC, whose finalizers run Python code)
fails the scrape with "dictionary changed size during iteration" when the loop's thread comes
in mid-walk. The collectors copy with `dict(d)` first, one C call (docs/metrics.md). Without
the copies each test here fails at once: the eviction test with threads switched as often as
the interpreter can and the GC run every few allocations beside a writer whose garbage has
finalizers; the directory test deterministically, a change at every call the scrape makes."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from kvfabric.core.directory import DirectoryConfig, DirectoryCore
from kvfabric.core.eviction import EvictionConfig, EvictionCore
from kvfabric.core.quotas import TenantUsage
from kvfabric.directory.admission import AdmissionConfig, FairAdmission
from kvfabric.directory.metrics import DirectoryCollector
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.shell import DirectoryShell
from kvfabric.format.ids import DomainDigest
from kvfabric.proto import directory as m
from tests.unit.core.dirkit import SECRET

WRITES = 5_000
LIVE = 64  # keys the writer keeps in each table: a read's cost stays flat


class _Finalized:
    """Cyclic garbage whose finalizer runs Python code (as asyncio's and sockets' do)."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        time.sleep(0)  # gives the GIL away, as any Python code in a finalizer may


@contextmanager
def _gc_pressure() -> Iterator[None]:
    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(50, 1_000, 1_000)  # the young generation every 50 allocations, the heap rarely
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)
        gc.collect()


def _read_beside(read: Callable[[], object], write: Callable[[int], None]) -> tuple[int, int]:
    """Calls `read` in a thread while `write` runs here WRITES times; returns (reads, writes).
    Any exception of a read fails the test."""
    errors: list[BaseException] = []
    reads = 0
    done = threading.Event()

    def reader() -> None:
        nonlocal reads
        while not done.is_set():
            try:
                read()
            except Exception as exc:
                errors.append(exc)
                return
            reads += 1

    writes = 0
    with _gc_pressure():
        thread = threading.Thread(target=reader)
        thread.start()
        try:
            while writes < WRITES and not errors:
                write(writes)
                writes += 1
                _Finalized()
        finally:
            done.set()
            thread.join(10)
    assert not thread.is_alive()
    assert not errors, repr(errors[0])
    assert reads > 0, (reads, writes)
    return reads, writes


def test_eviction_tenants_are_read_while_the_loop_adds_tenants() -> None:
    core = EvictionCore(EvictionConfig(policy="lru"))
    core.set_capacity("s1", 1 << 40)

    def write(i: int) -> None:
        core.insert(i, tenant=i, pool="s1", size=1, parent=None, chunk_index=0, now_ms=i)

    _, writes = _read_beside(core.tenants, write)
    assert len(core.tenants()) == writes


def test_the_directory_collector_reads_tables_changed_at_every_step_of_its_walk() -> None:
    """Deterministic, one thread: a profile hook changes the tables the collector reads (an add
    or a removal) at every call the scrape makes, where the loop's thread could come in. The
    collector's Python-level walks of live dicts failed this at once (`Counter.update(d)` of a
    second shard's counters); a copy made by `dict(d)` is made in one C call."""
    config = DirectoryConfig(ticket_secret=SECRET)
    host = ShardHost("dir-a", 2, config, registry=cast(Any, None), make_shell=cast(Any, None))
    cores = [DirectoryCore(config, shard=shard) for shard in (0, 1)]
    for shard, core in enumerate(cores):  # two shells: counters of the second are summed in Python
        host.shells[shard] = DirectoryShell(
            core, tick_ms=100, events_outbox_max=1_000, events_max_age_s=60, free_timeout_s=1
        )
    collector = DirectoryCollector(host)
    writes = 0
    writing = False  # the hook does nothing for the calls a write makes itself

    def write() -> None:
        nonlocal writes, writing
        if writing:
            return
        writing = True
        try:
            _write(writes)
        finally:
            writes += 1
            writing = False

    live: deque[tuple[DirectoryCore, int]] = deque()  # keys added, oldest first

    def _write(i: int) -> None:
        # every step changes a table's size: a removal of the oldest key once LIVE are held,
        # else an add (new segments too, the first LIVE times)
        if i % 2 and len(live) >= LIVE:
            core, n = live.popleft()
            del core.counters[f"made_up_{n}_total"]
            del core.quotas.usage[DomainDigest(n.to_bytes(8, "big"))]
            return
        core = cores[i // 2 % 2]
        if i < LIVE:
            core.handle(
                m.RegisterSegment(
                    segment_id=f"segment-{i:05d}",
                    incarnation=1,
                    capacity_bytes=1 << 30,
                    domain=m.FailureDomain(host=f"host-{i}", zone="zone-0"),
                    data_addr=f"tcp://10.0.0.1:{i}",
                ),
                i,
            )
        core.counters[f"made_up_{i}_total"] = 1
        core.quotas.usage[DomainDigest(i.to_bytes(8, "big"))] = TenantUsage(bytes=i, objects=1)
        live.append((core, i))

    def hook(frame: object, event: str, arg: object) -> None:
        if event in ("call", "c_call") and not writing:
            write()

    for _ in range(2 * LIVE):  # tables with entries to walk: LIVE keys
        write()
    for _ in range(3):
        sys.setprofile(hook)
        try:
            families = list(collector.collect())
        finally:
            sys.setprofile(None)
        assert families
    assert writes > 1_000  # a change at every call of three scrapes
    names = {f.name: f for f in collector.collect()}
    assert len(names["kvfabric_directory_tenant_used_bytes"].samples) == len(live)
    assert len(names["kvfabric_directory_segment_up"].samples) == LIVE


def test_the_fair_admission_wait_gauge_reads_tenants_changed_at_every_call() -> None:
    """`take_longest_wait` (the directory collector's `fair_longest_wait_seconds`) walks the
    tenants' queue heads while the loop offers, starts and ends requests: at every call it makes,
    a profile hook adds a tenant with a queued request and serves one (emptying its queue)."""
    core = FairAdmission(
        AdmissionConfig(
            ids_per_s=1_000_000, burst_ids=1_000_000, queue_max=4, running_max=1, tenant_running_max=1
        )
    )
    changes = 0
    changing = False

    def change() -> None:
        nonlocal changes, changing
        if changing:
            return
        changing = True
        try:
            core.offer(f"tenant-{changes}", 1, float(changes))  # a new tenant's request waits
            for started in core.start(float(changes)):  # one runs and ends: its queue empties
                core.done(started.tenant, float(changes))
        finally:
            changes += 1
            changing = False

    def hook(frame: object, event: str, arg: object) -> None:
        if event in ("call", "c_call"):
            change()

    for i in range(LIVE):  # a backlog: each change then adds one request and serves one
        core.offer(f"waiting-{i}", 1, 0.0)
    for _ in range(20):
        sys.setprofile(hook)
        try:
            waited = core.take_longest_wait(1e9)
        finally:
            sys.setprofile(None)
        assert waited > 0
    core.check()
    assert changes > 20 and core.queued == LIVE

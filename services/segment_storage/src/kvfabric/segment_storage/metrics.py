"""Exports the slot table's space figures and the segment's plain counters at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvfabric.segment_storage.shell import SegmentShell

__all__ = ["SegmentCollector", "rejected_connections"]


class SegmentCollector(Collector):
    def __init__(self, shell: SegmentShell) -> None:
        self.shell = shell

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        shell = self.shell
        slots, backend = shell.slots, shell.backend
        with backend.lock:
            figures = {
                "kvfabric_segment_arena_bytes": ("Arena size.", slots.arena_bytes),
                "kvfabric_segment_arena_prefaulted_bytes": (
                    "Arena bytes faulted in by the start's prefault so far (KVF_SEGMENT_ARENA_PREFAULT).",
                    shell.arena.prefaulted_bytes,
                ),
                "kvfabric_segment_used_bytes": (
                    "Bytes of live extents (writing, stored, freeing).",
                    slots.used_bytes,
                ),
                "kvfabric_segment_free_bytes": ("Free bytes.", slots.free_bytes),
                "kvfabric_segment_largest_free_bytes": ("Largest free extent.", slots.largest_free_bytes),
                "kvfabric_segment_fragmentation_ratio": (
                    "1 - largest free extent / free bytes.",
                    slots.fragmentation,
                ),
                "kvfabric_segment_slots_in_use": ("Slots writing, stored or freeing.", slots.slots_in_use),
                "kvfabric_segment_deferred_frees": (
                    "Frees waiting for a transfer to end.",
                    slots.deferred_frees,
                ),
                "kvfabric_segment_incarnation": ("This process's incarnation.", shell.incarnation),
                "kvfabric_segment_draining": ("1 while refusing new writes.", int(backend.draining)),
            }
            counters = {**slots.counters, **backend.counters}
        ssd = shell.ssd.stats() if shell.ssd is not None else {}
        figures.update(
            {
                "kvfabric_segment_ssd_capacity_bytes": (
                    "Disk tier data bytes (0: no disk tier).",
                    ssd.get("capacity_bytes", 0),
                ),
                "kvfabric_segment_ssd_used_bytes": (
                    "Disk tier bytes of live extents (writing, stored, being unlinked).",
                    ssd.get("used_bytes", 0),
                ),
                "kvfabric_segment_ssd_objects": ("Objects stored in the disk tier.", ssd.get("objects", 0)),
                "kvfabric_segment_ssd_read_bytes_in_flight": (
                    "Disk read buffers held (bounded by KVF_SEGMENT_SSD_READ_BYTES_MAX).",
                    ssd.get("read_bytes_in_flight", 0),
                ),
                "kvfabric_segment_ssd_failed": (
                    "1 once a disk sync failed (no more disk writes until restart).",
                    ssd.get("failed", 0),
                ),
            }
        )
        if shell.ssd is not None:
            counters.update(shell.ssd.all_counters())
        latency = HistogramMetricFamily(
            "kvfabric_segment_ssd_io_seconds",
            "Disk tier I/O: a write (data, syncs, commit record) or a read (read, checksum), by op.",
            labels=["op"],
        )
        for op, (buckets, total) in (shell.ssd.io_latency() if shell.ssd is not None else {}).items():
            latency.add_metric([op], [(_le(bound), n) for bound, n in buckets], total)
        yield latency
        tier_bytes = GaugeMetricFamily(
            "kvfabric_segment_tier_bytes",
            "Bytes in live slots, by tier (dram: arena, ssd: disk).",
            labels=["tier"],
        )
        tier_objects = GaugeMetricFamily(
            "kvfabric_segment_tier_objects",
            "Slots in use (writing, stored, being freed), by tier.",
            labels=["tier"],
        )
        tier_bytes.add_metric(["dram"], figures["kvfabric_segment_used_bytes"][1])
        tier_objects.add_metric(["dram"], figures["kvfabric_segment_slots_in_use"][1])
        if shell.ssd is not None:
            tier_bytes.add_metric(["ssd"], ssd["used_bytes"])
            tier_objects.add_metric(["ssd"], ssd["slots_in_use"])
        yield tier_bytes
        yield tier_objects
        moves = CounterMetricFamily(
            "kvfabric_segment_tier_moves",
            "Objects copied between this segment's tiers: demotion (to disk), promotion (to the arena).",
            labels=["direction"],
        )
        moves.add_metric(["demotion"], counters.get("demotions_total", 0))
        moves.add_metric(["promotion"], counters.get("promotions_total", 0))
        yield moves
        for name, (doc, value) in figures.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        events = CounterMetricFamily("kvfabric_segment_events", "Segment counters, by name.", labels=["name"])
        for name, value in sorted(counters.items()):
            events.add_metric([name.removesuffix("_total")], value)
        yield events
        yield CounterMetricFamily(
            "kvfabric_segment_rejected_connections",
            "Data connections refused (busy), TCP and UCX.",
            value=rejected_connections(shell),
        )


def rejected_connections(shell: SegmentShell) -> int:
    """Data connections refused `busy`, by either transport (UCX's were left out)."""
    ucx = shell.ucx.server if shell.ucx is not None else None
    return shell.server.rejected_busy + (ucx.rejected_busy if ucx is not None else 0)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)

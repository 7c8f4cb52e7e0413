"""Exports the shard cores' plain counters and state sizes as Prometheus metrics (read at scrape
time): gauges summed over the shards this instance leads (the epoch per shard); counters over
those, the shells still draining after a handover, and every shell retired before
(`kvfabric.directory.retired`: a shard handed over or rebuilt took its totals out of the sum,
and Prometheus read a counter reset; review, stop 71); the events stream's counters over every
stream those shells used, each once, so they stay while the instance leads no shard."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvfabric.core.directory import DirectoryCore
from kvfabric.core.leadership import ShardLeadership
from kvfabric.directory.retired import RetiredCounters
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.shell import DirectoryShell
from kvfabric.directory.stalls import CORE_CALL_BUCKETS_S, CORE_CALLS

__all__ = ["DirectoryCollector"]


class DirectoryCollector(Collector):
    def __init__(self, host: ShardHost, leadership: ShardLeadership | None = None) -> None:
        self.host = host
        self.leadership = leadership  # the instance's shard-leadership core (its counters)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        # Scraped from another thread: every live dict of the loop's is copied whole with dict()
        # (in C, no allocation mid-walk) before Python walks it (docs/metrics.md)
        with self.host.retired.lock:  # a shell moved meanwhile is counted once, not twice or never
            shells = list(dict(self.host.shells).items())
            counted = [shell for _, shell in shells] + list(self.host.draining)
            retired = self.host.retired.copy()
        cores = [shell.core for _, shell in shells]
        counters: Counter[str] = Counter(retired.core)
        for shell in counted:
            counters.update(dict(shell.core.counters))
        events = CounterMetricFamily(
            "kvfabric_directory_core_events", "Core counters, by name.", labels=["name"]
        )
        for name, value in sorted(counters.items()):
            events.add_metric([name.removesuffix("_total")], value)
        yield events
        yield CounterMetricFamily(
            "kvfabric_directory_shard_map_rate_limited",
            "Tenants' shard_map requests left unanswered (over SHARD_MAP_TENANT_PER_S).",
            value=self.host.shard_map_rate_limited,
        )
        yield CounterMetricFamily(
            "kvfabric_directory_missing_segment_rebuilds",
            "Shards rebuilt because a segment holding bytes was unknown to them.",
            value=self.host.missing_segment_rebuilds,
        )
        yield CounterMetricFamily(
            "kvfabric_directory_events_published",
            "Events JetStream acknowledged.",
            value=retired.events_published + sum(shell.events_published for shell in counted),
        )
        yield CounterMetricFamily(
            "kvfabric_directory_events_dropped",
            "Events of a stopped shard core never known to reach JetStream (still queued when a "
            "handover's drain ended); the shard's next core's shard_started event tells followers.",
            value=retired.events_dropped + sum(shell.events_dropped for shell in counted),
        )
        yield from self._events_stream(counted, retired)
        if self.leadership is not None:
            leadership = CounterMetricFamily(
                "kvfabric_directory_leadership_events",
                "Shard leader lease operations and outcomes, by name (renew_unanswered: a renewal "
                "without an answer, retried within the term; lease_expired: a lease lost).",
                labels=["name"],
            )
            for name, value in sorted(dict(self.leadership.counters).items()):
                leadership.add_metric([name.removesuffix("_total")], value)
            yield leadership
        state = GaugeMetricFamily("kvfabric_directory_groups", "Chunk groups by state.", labels=["state"])
        state.add_metric(["building"], sum(len(c.building) for c in cores))
        state.add_metric(["published"], sum(len(c.published) for c in cores))
        state.add_metric(["evicting"], sum(len(c.evicting) for c in cores))
        yield state
        yield GaugeMetricFamily(
            "kvfabric_directory_pending_objects",
            "Objects being written.",
            value=sum(c.pending_objects for c in cores),
        )
        yield GaugeMetricFamily(
            "kvfabric_directory_shards_led", "Shards this instance leads.", value=len(cores)
        )
        epoch = GaugeMetricFamily(
            "kvfabric_directory_epoch", "Epoch of each shard led here.", labels=["shard"]
        )
        for shard, shell in shells:
            epoch.add_metric([str(shard)], shell.core.epoch)
        yield epoch
        leases = GaugeMetricFamily("kvfabric_directory_leases", "Read leases and pins held.", labels=["kind"])
        pins = sum(c.pins_held for c in cores)
        leases.add_metric(["pin"], pins)
        leases.add_metric(["read"], sum(c.leases_held for c in cores) - pins)
        yield leases
        up = GaugeMetricFamily(
            "kvfabric_directory_segment_up", "1 when the segment is up.", labels=["segment"]
        )
        reserved = GaugeMetricFamily(
            "kvfabric_directory_segment_reserved_bytes",
            "Bytes placed on a segment (by the shards led here).",
            labels=["segment"],
        )
        seen_up: dict[str, bool] = {}
        placed: Counter[str] = Counter()
        for core in cores:
            for seg in dict(core.segments).values():
                seen_up[seg.segment_id] = seen_up.get(seg.segment_id, True) and seg.up
                placed[seg.segment_id] += seg.reserved_bytes
        for segment_id, is_up in sorted(seen_up.items()):
            up.add_metric([segment_id], 1.0 if is_up else 0.0)
            reserved.add_metric([segment_id], placed[segment_id])
        yield up
        yield reserved
        yield from self._tenants(cores, [shell.core for shell in counted], retired)
        yield from self._core_calls()
        yield from self._fair()

    def _events_stream(
        self, counted: list[DirectoryShell], retired: RetiredCounters
    ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """The events stream's health (`kvfabric.directory.events`): failed publish attempts by
        reason, publishers stuck now, recreations of a stuck stream and repairs that failed. The
        streams of the shells serving, draining and folded (`retired`), each once: the instance's
        stream counts on while it leads no shard, and these counters never go down (a standby
        exported 0 here, a counter reset)."""
        streams = {id(s.events_stream): s.events_stream for s in counted if s.events_stream}
        streams.update(retired.streams)
        totals = retired.stream_counts.copy()
        for stream in streams.values():
            totals.add(stream)
        failures = CounterMetricFamily(
            "kvfabric_directory_events_publish_failures",
            "Failed attempts to append an event to the events stream, by reason.",
            labels=["reason"],
        )
        for reason in ("timeout", "no_responders", "unavailable", "api_error", "other"):
            failures.add_metric([reason], totals.failures[reason])
        yield failures
        yield GaugeMetricFamily(
            "kvfabric_directory_events_publish_stuck",
            "Shards whose next event failed KVF_DIRECTORY_EVENTS_STUCK_AFTER_FAILURES times in a row "
            "(alert when above 0 for a minute: docs/chaos.md, runbook).",
            value=sum(len(stream.stuck) for stream in streams.values()),
        )
        yield CounterMetricFamily(
            "kvfabric_directory_events_stream_recreated",
            "Events stream added again by this instance (stuck on a store write error, or missing).",
            value=totals.recreated,
        )
        yield CounterMetricFamily(
            "kvfabric_directory_events_stream_repairs_failed",
            "Repairs of a stuck events stream whose delete or add failed.",
            value=totals.repairs_failed,
        )

    def _fair(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Fair admission (`kvfabric.directory.fair`): refusals by tenant and bucket, queues."""
        gate = self.host.fair
        if gate is None:
            return
        core = gate.core
        refused = CounterMetricFamily(
            "kvfabric_directory_fair_refused",
            "Tenant requests refused busy before any work: reason rate (the tenant's ids-a-second "
            "bucket) or queue (its requests waiting for a turn were at KVF_DIRECTORY_FAIR_TENANT_QUEUE_MAX).",
            labels=["tenant", "reason"],
        )
        for tenant, stats in sorted(dict(core.refused).items()):  # written by the loop: a copy
            refused.add_metric([tenant, "rate"], stats.rate)
            refused.add_metric([tenant, "queue"], stats.queue)
        yield refused
        yield CounterMetricFamily(
            "kvfabric_directory_fair_admitted", "Tenant requests given a turn.", value=core.admitted_total
        )
        yield CounterMetricFamily(
            "kvfabric_directory_fair_waited_out",
            "Tenant requests answered busy after waiting TURN_WAIT_S_MAX for a turn.",
            value=gate.waited_out_total,
        )
        yield CounterMetricFamily(
            "kvfabric_directory_fair_buckets_suspended",
            "Tarpits that suspended the tenant's bucket for their length "
            "(it banks no budget while its requests go unread).",
            value=core.suspended_total,
        )
        yield GaugeMetricFamily(
            "kvfabric_directory_fair_queued", "Tenant requests waiting for their turn now.", value=core.queued
        )
        yield GaugeMetricFamily(
            "kvfabric_directory_fair_running", "Tenant requests running now.", value=core.running
        )
        yield GaugeMetricFamily(
            "kvfabric_directory_fair_longest_wait_seconds",
            "The longest wait for a turn since the previous scrape (started or still waiting).",
            value=core.take_longest_wait(gate.clock()),
        )
        yield GaugeMetricFamily(
            "kvfabric_directory_fair_tenants_tracked",
            "Tenants fair admission holds state for (idle ones are forgotten once their bucket is full).",
            value=core.tracked,
        )
        yield CounterMetricFamily(
            "kvfabric_directory_giveback_empty_ids",
            "Ids of tenants' give-backs (release, unpin, abort) that released nothing, "
            "charged to their budget.",
            value=gate.giveback.empty_ids_total,
        )
        yield CounterMetricFamily(
            "kvfabric_directory_giveback_refused",
            "Tenants' give-backs refused busy: the tenant's budget was spent and the first "
            "slice released nothing, or (before decoding) its last spent slice had.",
            value=gate.giveback.refused_total + gate.giveback.refused_early_total,
        )

    def _core_calls(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
        """How long synchronous core calls held the event loop (`kvfabric.directory.stalls`)."""
        counts = list(CORE_CALLS.bucket_counts)  # written by the loop's thread: a snapshot
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, n in zip((*CORE_CALL_BUCKETS_S, float("inf")), counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily(
            "kvfabric_directory_core_call_seconds",
            "Synchronous core calls (requests, ticks, charges): how long each held the event loop.",
            buckets=buckets,
            sum_value=CORE_CALLS.sum_s,
        )
        longest_s, _ = CORE_CALLS.take_longest()
        yield GaugeMetricFamily(
            "kvfabric_directory_core_call_longest_seconds",
            "The longest synchronous core call since the previous scrape (the worst event-loop stall).",
            value=longest_s,
        )

    def _tenants(
        self, cores: list[DirectoryCore], counted: list[DirectoryCore], retired: RetiredCounters
    ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Per share domain (hex digest): what it holds (the `cores` led) and what it was refused
        (the `counted` cores, led or draining, and the `retired` ones)."""
        used = GaugeMetricFamily(
            "kvfabric_directory_tenant_used_bytes",
            "Bytes a tenant holds (size x replicas: building, published, copying, freeing).",
            labels=["domain"],
        )
        objects = GaugeMetricFamily(
            "kvfabric_directory_tenant_objects", "Objects a tenant holds.", labels=["domain"]
        )
        used_bytes: Counter[bytes] = Counter()
        used_objects: Counter[bytes] = Counter()
        quota_exceeded: Counter[bytes] = Counter()
        rate_limited: Counter[bytes] = Counter()
        for core in cores:
            for domain, use in dict(core.quotas.usage).items():
                used_bytes[domain] += use.bytes
                used_objects[domain] += use.objects
        for domain, (exceeded, limited) in retired.tenants.items():
            quota_exceeded[domain] += exceeded
            rate_limited[domain] += limited
        for core in counted:
            # an OrderedDict: its copy() is one C walk (dict() of it is a keys list, then lookups)
            for domain, stats in core.quotas.stats.copy().items():
                quota_exceeded[domain] += stats.quota_exceeded
                rate_limited[domain] += stats.rate_limited
        for tenant in sorted(used_bytes):
            used.add_metric([tenant.hex()], used_bytes[tenant])
            objects.add_metric([tenant.hex()], used_objects[tenant])
        yield used
        yield objects
        rejected = CounterMetricFamily(
            "kvfabric_directory_tenant_rejected",
            "Refusals by quota (objects) or rate limit (requests), per tenant tracked.",
            labels=["domain", "reason"],
        )
        for tenant in sorted(set(quota_exceeded) | set(rate_limited)):
            rejected.add_metric([tenant.hex(), "quota_exceeded"], quota_exceeded[tenant])
            rejected.add_metric([tenant.hex(), "rate_limited"], rate_limited[tenant])
        yield rejected

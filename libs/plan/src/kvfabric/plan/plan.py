"""Assembles a `Plan` (msgspec Structs, the `--json` output) from the four inputs. Pure."""

from __future__ import annotations

import math

import msgspec

from kvfabric.format.key import CHUNK_GROUP_BYTES, KEY_BYTES
from kvfabric.plan import formulas as f
from kvfabric.plan.model import Cluster, Layout, ModelSpec, Workload

__all__ = [
    "Capacity",
    "Constraint",
    "DomainLoss",
    "Expansion",
    "Metadata",
    "Plan",
    "Sizes",
    "SsdTier",
    "Traffic",
    "Verdict",
    "build_plan",
]


class Inputs(msgspec.Struct, frozen=True):
    model: ModelSpec
    layout: Layout
    workload: Workload
    cluster: Cluster


class Sizes(msgspec.Struct, frozen=True):
    kv_elements_per_token_per_layer: int
    kv_bytes_per_token: float
    tp_duplication: float
    stored_bytes_per_token: float
    chunk_bytes: float
    objects_per_chunk: int
    object_bytes: float
    chunks_per_prefix: int
    chunks_per_prefix_max: int
    prefix_bytes: float
    prefix_bytes_max: float
    chunk_groups: int
    objects: int
    object_replicas: int


class Metadata(msgspec.Struct, frozen=True):
    key_bytes: int
    chunk_group_id_bytes: int
    keys_bytes: int
    group_record_bytes: int
    directory_record_bytes: int
    directory_ram_bytes: int
    manifest_bytes: int
    manifest_bytes_max: int
    manifests_bytes: int
    lookups_groups_per_s: float
    publishes_objects_per_s: float
    lookup_shards_needed: int
    publish_shards_needed: int


class Capacity(msgspec.Struct, frozen=True):
    logical_bytes: float
    replicated_bytes: float
    usable_bytes: float
    utilization: float
    per_host_bytes: float
    per_host_usable_bytes: float
    hosts_per_domain: int
    per_domain_bytes: float
    per_domain_usable_bytes: float
    fits: bool


class Traffic(msgspec.Struct, frozen=True):
    read_bytes_per_s: float
    write_bytes_per_s: float
    per_host_read_bytes_per_s: float
    per_host_write_bytes_per_s: float
    hotspot_factor: float
    peak_host_egress_bytes_per_s: float
    peak_host_ingress_bytes_per_s: float
    nic_bytes_per_s: float
    nic_usable_bytes_per_s: float
    repair_budget_per_host_bytes_per_s: float
    nic_utilization: float
    fits: bool


class SsdTier(msgspec.Struct, frozen=True):
    """The disk tier under DRAM (issue 23): DRAM holds the hottest bytes, the SSD the rest.
    `demotion_bytes_per_s`: while the set spills over DRAM, every byte written into DRAM pushes
    one out, demoted at `demote_share` (a promoted object keeps its disk copy: no rewrite).
    `write_amplification`: bytes demoted per byte read from the SSD. Utilizations are 0 where
    the disk's bandwidth was not given."""

    enabled: bool
    capacity_bytes: float
    per_host_capacity_bytes: float
    dram_resident_bytes: float
    ssd_resident_bytes: float
    utilization: float
    fits: bool
    dram_read_share: float
    read_share: float
    read_bytes_per_s: float
    per_host_read_bytes_per_s: float
    demotion_bytes_per_s: float
    per_host_demotion_bytes_per_s: float
    write_amplification: float
    drive_writes_per_day: float
    read_utilization: float
    write_utilization: float
    bandwidth_fits: bool


class DomainLoss(msgspec.Struct, frozen=True):
    hosts_lost: int
    hosts_left: int
    usable_bytes_left: float
    utilization_after: float
    lost_replica_bytes: float
    repair_bytes_per_s: float
    repair_seconds: float
    repairable: bool
    unrepaired_bytes: float
    peak_host_egress_bytes_per_s: float
    nic_utilization_after: float
    fits: bool


class Expansion(msgspec.Struct, frozen=True):
    hosts_added: int
    hosts_after: int
    usable_bytes_after: float
    utilization_after: float
    moved_bytes: float
    move_bytes_per_s: float
    move_seconds: float
    fits: bool


class Constraint(msgspec.Struct, frozen=True):
    name: str
    demand: float
    supply: float
    utilization: float
    ok: bool
    unit: str
    hosts_needed: int


class Verdict(msgspec.Struct, frozen=True):
    fits: bool
    binding: str
    hosts_needed: int
    hosts_needed_domain_loss: int
    constraints: tuple[Constraint, ...]
    summary: str


class Plan(msgspec.Struct, frozen=True):
    inputs: Inputs
    sizes: Sizes
    metadata: Metadata
    capacity: Capacity
    traffic: Traffic
    ssd: SsdTier
    domain_loss: DomainLoss
    expansion: Expansion
    verdict: Verdict


def _sizes(model: ModelSpec, layout: Layout, work: Workload, cluster: Cluster) -> Sizes:
    per_token = f.kv_bytes_per_token(model)
    dup = f.tp_duplication(model, layout.tp, dedup=layout.tp_dedup)
    stored = per_token * dup
    members = f.objects_per_chunk_group(layout.tp, layout.pp, layout.layer_groups)
    chunk_bytes = stored * layout.chunk_tokens
    chunks = f.full_chunks(work.prefix_tokens, layout.chunk_tokens)
    groups = work.prefixes * chunks
    return Sizes(
        kv_elements_per_token_per_layer=0
        if model.kv_bytes_per_token
        else f.kv_elements_per_token_per_layer(model),
        kv_bytes_per_token=per_token,
        tp_duplication=dup,
        stored_bytes_per_token=stored,
        chunk_bytes=chunk_bytes,
        objects_per_chunk=members,
        object_bytes=chunk_bytes / members,
        chunks_per_prefix=chunks,
        chunks_per_prefix_max=f.full_chunks(work.max_tokens, layout.chunk_tokens),
        prefix_bytes=chunks * chunk_bytes,
        prefix_bytes_max=f.full_chunks(work.max_tokens, layout.chunk_tokens) * chunk_bytes,
        chunk_groups=groups,
        objects=groups * members,
        object_replicas=groups * members * cluster.replicas,
    )


def _metadata(s: Sizes, layout: Layout, work: Workload, cluster: Cluster) -> Metadata:
    record = f.group_record_bytes(s.objects_per_chunk, cluster.replicas)
    obj = math.ceil(s.object_bytes)
    manifest = f.manifest_bytes(s.chunks_per_prefix, layout.tp, layout.pp, layout.layer_groups, obj)
    manifest_max = f.manifest_bytes(s.chunks_per_prefix_max, layout.tp, layout.pp, layout.layer_groups, obj)
    # Every request probes its prefix's chunk groups (up to the longest it could need).
    lookups = work.request_rate * s.chunks_per_prefix
    publishes = work.request_rate * work.write_share * s.chunks_per_prefix * s.objects_per_chunk
    return Metadata(
        key_bytes=KEY_BYTES,
        chunk_group_id_bytes=CHUNK_GROUP_BYTES,
        keys_bytes=s.objects * KEY_BYTES,
        group_record_bytes=record,
        directory_record_bytes=s.chunk_groups * record,
        directory_ram_bytes=f.directory_ram_bytes(s.chunk_groups, s.objects_per_chunk, cluster.replicas),
        manifest_bytes=manifest,
        manifest_bytes_max=manifest_max,
        manifests_bytes=work.prefixes * manifest,
        lookups_groups_per_s=lookups,
        publishes_objects_per_s=publishes,
        lookup_shards_needed=max(1, math.ceil(lookups / f.DIRECTORY_LOOKUP_GROUPS_PER_S)),
        publish_shards_needed=max(1, math.ceil(publishes / f.DIRECTORY_PUBLISH_OBJECTS_PER_S)),
    )


def build_plan(model: ModelSpec, layout: Layout, work: Workload, cluster: Cluster) -> Plan:
    s = _sizes(model, layout, work, cluster)
    meta = _metadata(s, layout, work, cluster)
    hosts, reps = cluster.hosts, cluster.replicas
    host_usable = cluster.dram_gib * 2**30 * cluster.usable_fraction
    host_ssd = cluster.ssd_gib * 2**30 * cluster.ssd_usable_fraction
    host_store = host_usable + host_ssd  # what a host holds, DRAM and SSD tiers together

    # Capacity.
    logical = s.chunk_groups * s.chunk_bytes
    replicated = logical * reps
    usable = hosts * host_usable
    per_domain_hosts = f.domain_hosts_lost(hosts, cluster.domains)
    cap = Capacity(
        logical_bytes=logical,
        replicated_bytes=replicated,
        usable_bytes=usable,
        utilization=replicated / usable,
        per_host_bytes=replicated / hosts,
        per_host_usable_bytes=host_usable,
        hosts_per_domain=per_domain_hosts,
        per_domain_bytes=replicated / cluster.domains,
        per_domain_usable_bytes=per_domain_hosts * host_usable,
        fits=replicated <= usable,
    )

    # Traffic: a remote load reads one replica of the whole prefix; a write stores every replica.
    nic = f.gbps_to_bytes_per_s(cluster.nic_gbps)
    nic_usable = nic * cluster.nic_usable_fraction
    repair_budget = nic * cluster.repair_share
    reads = work.request_rate * work.remote_share * s.prefix_bytes
    writes = work.request_rate * work.write_share * s.prefix_bytes * reps

    def hotspot(n_hosts: int) -> float:
        if work.hotspot_factor:
            return work.hotspot_factor
        hot_units = work.prefixes * work.hot_prefix_share * s.chunks_per_prefix * reps
        return f.hotspot_factor(hot_units, n_hosts, work.hot_read_share)

    hot = hotspot(hosts)
    egress = reads / hosts * hot
    ingress = writes / hosts
    peak = max(egress, ingress)
    traffic = Traffic(
        read_bytes_per_s=reads,
        write_bytes_per_s=writes,
        per_host_read_bytes_per_s=reads / hosts,
        per_host_write_bytes_per_s=ingress,
        hotspot_factor=hot,
        peak_host_egress_bytes_per_s=egress,
        peak_host_ingress_bytes_per_s=ingress,
        nic_bytes_per_s=nic,
        nic_usable_bytes_per_s=nic_usable,
        repair_budget_per_host_bytes_per_s=repair_budget,
        nic_utilization=peak / nic_usable,
        fits=peak <= nic_usable,
    )

    ssd = _ssd_tier(work, cluster, cap, traffic, hot, host_ssd)

    # One failure domain lost: its replicas are re-created from the survivors, copying under the
    # repair budget of the hosts left (sources and targets both among them).
    lost = per_domain_hosts
    left = hosts - lost
    if left > 0:
        usable_left = left * host_store
        lost_bytes = replicated * lost / hosts
        can_keep = max(0.0, usable_left - (replicated - lost_bytes))
        unrepaired = max(0.0, lost_bytes - can_keep)
        repair_rate = left * repair_budget
        hot_left = hotspot(left)
        egress_left = reads / left * hot_left + repair_budget
        loss = DomainLoss(
            hosts_lost=lost,
            hosts_left=left,
            usable_bytes_left=usable_left,
            utilization_after=replicated / usable_left,
            lost_replica_bytes=lost_bytes,
            repair_bytes_per_s=repair_rate,
            repair_seconds=lost_bytes / repair_rate,
            repairable=unrepaired == 0 and reps > 1,
            unrepaired_bytes=unrepaired,
            peak_host_egress_bytes_per_s=egress_left,
            nic_utilization_after=max(egress_left, writes / left + repair_budget) / nic_usable,
            fits=replicated <= usable_left and reps > 1,
        )
    else:
        loss = DomainLoss(
            lost, 0, 0.0, math.inf, replicated, 0.0, math.inf, False, replicated, 0.0, math.inf, False
        )

    # Expansion by N hosts: the new hosts take their share; moves use the repair budget of all.
    after = hosts + cluster.expand_hosts
    moved = replicated * f.moved_fraction_on_expand(hosts, cluster.expand_hosts)
    # The new hosts receive everything: they bound the rate.
    move_rate = cluster.expand_hosts * repair_budget
    expansion = Expansion(
        hosts_added=cluster.expand_hosts,
        hosts_after=after,
        usable_bytes_after=after * host_store,
        utilization_after=replicated / (after * host_store),
        moved_bytes=moved,
        move_bytes_per_s=move_rate,
        move_seconds=moved / move_rate if move_rate else 0.0,
        fits=replicated <= after * host_store,
    )

    verdict = _verdict(s, meta, cap, traffic, ssd, loss, cluster, host_store)
    return Plan(Inputs(model, layout, work, cluster), s, meta, cap, traffic, ssd, loss, expansion, verdict)


def _ssd_tier(
    work: Workload, cluster: Cluster, cap: Capacity, t: Traffic, hot: float, host_ssd: float
) -> SsdTier:
    capacity = cluster.hosts * host_ssd
    replicated = cap.replicated_bytes
    dram_resident = min(replicated, cap.usable_bytes)
    ssd_resident = replicated - dram_resident if capacity > 0 else 0.0
    dram_fraction = dram_resident / replicated if replicated else 1.0
    dram_share = f.dram_read_share(dram_fraction, work.hot_prefix_share, work.hot_read_share)
    derived = 1 - dram_share if capacity > 0 else 0.0
    read_share = derived if work.ssd_read_share is None else work.ssd_read_share
    reads = t.read_bytes_per_s * read_share
    # Cold reads spread evenly; the hot-spot factor applies when hot prefixes live on the SSD.
    peak_reads = reads / cluster.hosts * (hot if dram_fraction < work.hot_prefix_share else 1.0)
    demotions = t.write_bytes_per_s * cluster.demote_share if ssd_resident > 0 else 0.0
    per_host_demotions = demotions / cluster.hosts
    read_bw = cluster.ssd_read_gib_s * 2**30
    write_bw = cluster.ssd_write_gib_s * 2**30
    read_util = peak_reads / read_bw if read_bw else 0.0
    write_util = per_host_demotions / write_bw if write_bw else 0.0
    return SsdTier(
        enabled=capacity > 0,
        capacity_bytes=capacity,
        per_host_capacity_bytes=host_ssd,
        dram_resident_bytes=dram_resident,
        ssd_resident_bytes=ssd_resident,
        utilization=ssd_resident / capacity if capacity else 0.0,
        fits=replicated <= cap.usable_bytes + capacity,
        dram_read_share=dram_share,
        read_share=read_share,
        read_bytes_per_s=reads,
        per_host_read_bytes_per_s=peak_reads,
        demotion_bytes_per_s=demotions,
        per_host_demotion_bytes_per_s=per_host_demotions,
        write_amplification=demotions / reads if reads else (math.inf if demotions else 0.0),
        drive_writes_per_day=f.drive_writes_per_day(per_host_demotions, cluster.ssd_gib * 2**30),
        read_utilization=read_util,
        write_utilization=write_util,
        bandwidth_fits=read_util <= 1 and write_util <= 1,
    )


def _verdict(
    s: Sizes,
    meta: Metadata,
    cap: Capacity,
    t: Traffic,
    ssd: SsdTier,
    loss: DomainLoss,
    cluster: Cluster,
    host_store: float,
) -> Verdict:
    """`host_store`: what one host holds (usable DRAM, plus the SSD tier's share of its disk)."""
    hosts = cluster.hosts
    need_cap = f.hosts_needed(cap.replicated_bytes, host_store)
    need_dom = f.hosts_needed(cap.replicated_bytes, host_store, domains=cluster.domains, survive=True)
    peak_total = max(t.peak_host_egress_bytes_per_s, t.peak_host_ingress_bytes_per_s) * hosts
    need_nic = max(1, math.ceil(peak_total / t.nic_usable_bytes_per_s - 1e-9))
    shards = cluster.directory_shards
    need_rates = need_nic  # hosts for the NICs and the disks' bandwidth
    store = "dram_ssd" if ssd.enabled else "dram"  # what holds the replicated set
    supply = cap.usable_bytes + ssd.capacity_bytes
    constraints: tuple[Constraint, ...] = (
        Constraint(
            store,
            cap.replicated_bytes,
            supply,
            cap.replicated_bytes / supply,
            cap.replicated_bytes <= supply,
            "B",
            need_cap,
        ),
        Constraint(
            f"{store}_after_domain_loss",
            cap.replicated_bytes,
            loss.usable_bytes_left,
            loss.utilization_after,
            loss.fits,
            "B",
            need_dom,
        ),
        Constraint(
            "nic",
            max(t.peak_host_egress_bytes_per_s, t.peak_host_ingress_bytes_per_s),
            t.nic_usable_bytes_per_s,
            t.nic_utilization,
            t.fits,
            "B/s per host",
            need_nic,
        ),
        Constraint(
            "replicas_vs_domains",
            cluster.replicas,
            cluster.domains,
            cluster.replicas / cluster.domains,
            cluster.replicas <= cluster.domains,
            "domains",
            hosts,
        ),
        Constraint(
            "directory_lookups",
            meta.lookups_groups_per_s,
            shards * f.DIRECTORY_LOOKUP_GROUPS_PER_S,
            meta.lookups_groups_per_s / (shards * f.DIRECTORY_LOOKUP_GROUPS_PER_S),
            meta.lookup_shards_needed <= shards,
            "groups/s",
            hosts,
        ),
        Constraint(
            "directory_publishes",
            meta.publishes_objects_per_s,
            shards * f.DIRECTORY_PUBLISH_OBJECTS_PER_S,
            meta.publishes_objects_per_s / (shards * f.DIRECTORY_PUBLISH_OBJECTS_PER_S),
            meta.publish_shards_needed <= shards,
            "objects/s",
            hosts,
        ),
    )
    for name, util, total, per_host_gib_s in (
        ("ssd_read_bandwidth", ssd.read_utilization, ssd.read_bytes_per_s, cluster.ssd_read_gib_s),
        ("ssd_write_bandwidth", ssd.write_utilization, ssd.demotion_bytes_per_s, cluster.ssd_write_gib_s),
    ):
        if ssd.enabled and per_host_gib_s > 0:
            need = max(1, math.ceil(total / (per_host_gib_s * 2**30) - 1e-9))
            constraints += (Constraint(name, util, 1.0, util, util <= 1, "of the disks", need),)
            need_rates = max(need_rates, need)
    binding = max(constraints, key=lambda c: c.utilization)
    fits = all(c.ok for c in constraints)
    hosts_needed = max(need_cap, need_rates)
    hosts_needed_dom = max(need_dom, need_rates)
    if fits:
        summary = (
            f"FITS on {hosts} hosts, also after losing a failure domain; "
            f"binding constraint: {binding.name} at {binding.utilization:.0%}"
        )
    else:
        failed = ", ".join(c.name for c in constraints if not c.ok)
        summary = (
            f"DOES NOT FIT: binding constraint {binding.name} at {binding.utilization:.0%} "
            f"(failing: {failed}); needs {hosts_needed} hosts, "
            f"{hosts_needed_dom} to survive losing one of {cluster.domains} failure domains"
        )
    return Verdict(fits, binding.name, hosts_needed, hosts_needed_dom, constraints, summary)

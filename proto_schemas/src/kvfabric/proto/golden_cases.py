"""Golden wire messages: one or more per family, pinned forever as bytes in proto_schemas/golden/.

`tools/gen_golden.py` writes the bytes of a case once (it never overwrites a file). The tests
decode every stored file with its family's decoder and compare it to the value here, so a change
that breaks old encodings (renamed field, changed type or tag) fails. Add a case for each new
message; never edit or delete an existing one (bump the tag version instead).
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvfabric.format.ids import ChainHash, DomainDigest, GroupId, Namespace, ObjectKey
from kvfabric.proto import common, dataplane, directory, echo, eviction, prefetch, repair, router, segment

__all__ = ["GOLDEN_CASES"]

# case name -> (family name in registry.FAMILIES, expected decoded value)
GOLDEN_CASES: Final[dict[str, tuple[str, msgspec.Struct]]] = {
    "common.error.busy": (
        "common.error",
        common.ErrorReply(
            code="busy", message="in-flight limit 64 reached", retryable=True, details={"limit": 64}
        ),
    ),
    "echo.say.v1": ("echo", echo.EchoRequest(text="hello", delay_ms=5)),
    "echo.said.v1": ("echo", echo.EchoReply(text="hello", instance_id="echo-1")),
    "dir.put_begin.v1": (
        "directory.request",
        directory.PutBegin(
            writer_id="w1",
            request_id="r1",
            replicas=2,
            write_ttl_ms=5000,
            epoch=3,
            objects=[
                directory.ObjectSpec(key=ObjectKey(bytes(range(96))), size_bytes=1 << 20, checksum=b"c" * 16)
            ],
        ),
    ),
    "dir.lookup.v1": (
        "directory.request",
        directory.Lookup(
            holder_id="h", groups=[GroupId(bytes(90))], members=[directory.Member(1, 0, 2)], lease_ttl_ms=900
        ),
    ),
    "dir.lookup_reply.v1": (
        "directory.reply",
        directory.LookupReply(
            epoch=3,
            hit_chunks=1,
            lease_id=7,
            lease_expires_ms=12345,
            objects=[
                directory.ObjectLocation(
                    chunk_index=0,
                    member=directory.Member(0, 0, 0),
                    size_bytes=4096,
                    checksum=b"k" * 16,
                    replicas=[
                        directory.Replica(
                            segment_id="s1",
                            incarnation=9,
                            slot=4,
                            slot_generation=2,
                            data_addr="tcp://127.0.0.1:7000",
                        )
                    ],
                )
            ],
        ),
    ),
    "dir.lookup_many.v1": (
        "directory.request",
        directory.LookupMany(
            holder_id="h",
            parts=[directory.LookupPart(shard=3, groups=[GroupId(bytes(90))], epoch=5)],
            members=[directory.Member(0, 0, 0)],
            lease_ttl_ms=900,
        ),
    ),
    "dir.lookup_many_reply.v1": (
        "directory.reply",
        directory.LookupManyReply(
            parts=[
                directory.LookupPartReply(shard=3, reply=directory.LookupReply(epoch=5, hit_chunks=0)),
                directory.LookupPartReply(shard=4, error="wrong_shard", message="not led here"),
            ]
        ),
    ),
    "dir.lease_release_many.v1": (
        "directory.request",
        directory.LeaseReleaseMany(
            holder_id="h", parts=[directory.ReleasePart(shard=2, lease_ids=[7, 8], epoch=4)]
        ),
    ),
    "dir.lease_release_many_reply.v1": (
        "directory.reply",
        directory.LeaseReleaseManyReply(
            parts=[
                directory.ReleasePartReply(shard=2, released=[7]),
                directory.ReleasePartReply(shard=5, error="wrong_shard", message="not led here"),
            ]
        ),
    ),
    "dir.replica_suspect.v1": (
        "directory.request",
        directory.ReplicaSuspect(segment_id="s1", incarnation=9, slot=4, slot_generation=2),
    ),
    "dir.ev.published.v1": (
        "directory.event",
        directory.GroupPublished(group=ChainHash(b"g" * 32), chunk_index=5, members=2, degraded=True),
    ),
    "dir.ev.published.v1.placements": (
        "directory.event",
        directory.GroupPublished(
            group=ChainHash(b"g" * 32),
            chunk_index=5,
            members=1,
            namespace=Namespace(b"n" * 54),
            parent=ChainHash(b"p" * 32),
            placements=[directory.SegmentBytes("s1", 4096), directory.SegmentBytes("s2", 4096)],
        ),
    ),
    "dir.ev.published_many.v1": (
        "directory.event",
        directory.GroupsPublished(
            groups=[
                directory.GroupPublished(
                    group=ChainHash(b"g" * 32),
                    chunk_index=5,
                    members=1,
                    namespace=Namespace(b"n" * 54),
                    parent=ChainHash(b"p" * 32),
                    placements=[directory.SegmentBytes("s1", 4096)],
                ),
                directory.GroupPublished(
                    group=ChainHash(b"h" * 32),
                    chunk_index=6,
                    members=2,
                    degraded=True,
                    namespace=Namespace(b"n" * 54),
                    parent=ChainHash(b"g" * 32),
                    placements=[directory.SegmentBytes("s2", 8192)],
                ),
            ]
        ),
    ),
    "dir.ev.accessed.v1": (
        "directory.event",
        directory.GroupsAccessed(groups=[directory.GroupHits(ChainHash(b"g" * 32), 3)]),
    ),
    "dir.ev.unpinned.v1": (
        "directory.event",
        directory.GroupsUnpinned(groups=[directory.GroupRef(ChainHash(b"g" * 32), DomainDigest(b"d" * 16))]),
    ),
    "dir.ev.shard_started.v1": ("directory.event", directory.ShardStarted(shard=3, epoch=7)),
    "evict.status_reply.v1": (
        "eviction",
        eviction.EvictionStatus(
            policy="gdsf",
            high_watermark=0.9,
            low_watermark=0.8,
            objects=2,
            events_applied=7,
            pools=[eviction.PoolUsage(segment_id="s1", capacity_bytes=100, used_bytes=50, evicting_bytes=0)],
            tenants=[
                eviction.TenantUsage(domain_digest=DomainDigest(b"d" * 16), used_bytes=50, hard_bytes=80)
            ],
            counters={"victims_total": 3},
        ),
    ),
    "evict.admission_filter.v1": (
        "eviction",
        eviction.AdmissionFilter(
            generated_ms=1_700_000_000_000,
            events_seq=42,
            policy="density",
            pools=[
                eviction.PoolAdmission(segment_id="s1", group_bytes_max=[-1, -1, 4096, 0, -1, -1, -1, -1])
            ],
            protected_domains=[DomainDigest(b"d" * 16)],
        ),
    ),
    "evict.explain_reply.v1": (
        "eviction",
        eviction.EvictionExplain(
            policy="density",
            tracked=True,
            features={"tenant": "64" * 16, "bytes": 4096, "leaf": True, "hit_density_per_byte_ms": 1.5e-9},
            decisions=[
                eviction.EvictionDecision(
                    at_ms=1_700_000_000_000, what="tracked", reason="always", pool="s1"
                ),
                eviction.EvictionDecision(
                    at_ms=1_700_000_000_500,
                    what="chosen",
                    reason="lowest_hit_density",
                    pool="s1",
                    cause="watermark",
                ),
                eviction.EvictionDecision(at_ms=1_700_000_000_510, what="stays", reason="leased"),
            ],
            admission=eviction.AdmissionExplain(
                generated_ms=1_700_000_000_000,
                length_class=2,
                protected=False,
                seen=True,
                limits={"s1": 4096},
            ),
        ),
    ),
    "dir.replicate_begin.v1": (
        "directory.request",
        directory.ReplicateBegin(
            writer_id="repair",
            request_id="r1",
            key=ObjectKey(bytes(96)),
            segment_id="s2",
            write_ttl_ms=5000,
            epoch=3,
        ),
    ),
    "dir.replica_corrupt.v1": (
        "directory.request",
        directory.ReplicaCorrupt(
            segment_id="s1", incarnation=9, key=ObjectKey(bytes(96)), slot=4, slot_generation=2, epoch=3
        ),
    ),
    "dir.list_tenants.v1": ("directory.request", directory.ListTenants(limit=50, epoch=3)),
    "dir.tenant_list.v1": (
        "directory.reply",
        directory.TenantList(
            epoch=3,
            tenants=[
                directory.TenantInfo(
                    domain_digest=DomainDigest(b"d" * 16),
                    used_bytes=4096,
                    objects=2,
                    bytes_max=8192,
                    objects_max=10,
                    requests_per_s=2.5,
                    burst=5,
                    quota_exceeded=1,
                    rate_limited=3,
                )
            ],
            default=directory.TenantInfo(
                domain_digest=DomainDigest(b""), used_bytes=0, objects=0, bytes_max=1024
            ),
        ),
    ),
    "dir.put_begin_reply.v1.quota_exceeded": (
        "directory.reply",
        directory.PutBeginReply(
            epoch=3, results=[directory.BeginResult(key=ObjectKey(bytes(96)), status="quota_exceeded")]
        ),
    ),
    "dir.lease_release.v1.batch": (
        "directory.request",
        directory.LeaseRelease(holder_id="h", lease_id=0, epoch=3, shard=5, lease_ids=[7, 8, 9]),
    ),
    "dir.lease_reply.v1.released": (
        "directory.reply",
        directory.LeaseReply(epoch=3, lease_id=0, expires_ms=0, released=[7, 9]),
    ),
    "seg.report.v1": ("segment", segment.ReportRequest(epoch=7, after_slot=10, limit=100)),
    "seg.report_reply.v1": (
        "segment",
        segment.SegmentReport(
            incarnation=9,
            capacity_bytes=1 << 30,
            used_bytes=4096,
            draining=False,
            objects=[segment.HeldObject(ObjectKey(bytes(96)), 4, 2, 4096, b"k" * 16)],
            next_after_slot=-1,
        ),
    ),
    "repair.status_reply.v1": (
        "repair",
        repair.RepairStatus(
            scans=3,
            below_target=1,
            bytes_copied=4096,
            drains_complete=["s3"],
            gauges={"copies_in_flight": 1},
            counters={"copies_ok_total": 2},
        ),
    ),
    "prefetch.hint.v1": (
        "prefetch",
        prefetch.PrefetchHint(
            hint_id="req-1",
            tenant="tenant-a",
            groups=[GroupId(bytes(90))],
            members=[directory.Member(0, 0, 0)],
            target_segment="s2",
            deadline_ms=1_000_000,
        ),
    ),
    "prefetch.hint_reply.v1": (
        "prefetch",
        prefetch.HintReply(hint_id="req-1", status="busy", reason="hints_full"),
    ),
    "router.route.v1": ("router", router.RouteRequest(tokens=[1, 2, 3], tenant="tenant-a")),
    "router.route_reply.v1": (
        "router",
        router.RouteReply(
            instance="e1",
            reason="cache_aware",
            estimates=[
                router.InstanceEstimate(
                    instance="e1",
                    ttft_s=0.05,
                    engine_tokens=128,
                    colocated_tokens=256,
                    remote_tokens=0,
                    compute_tokens=10,
                    queued_prefill_tokens=0,
                    queue=1,
                )
            ],
        ),
    ),
    "seg.free.v1": (
        "segment",
        segment.FreeSlotsRequest(
            segment_id="s1", incarnation=9, slots=[directory.FreedSlot(ObjectKey(b""), 4, 2)], epoch=3
        ),
    ),
    "seg.drain.v1": ("segment", segment.DrainRequest(draining=True)),
    "dir.register.v1.disk_objects": (
        "directory.request",
        directory.RegisterSegment(
            segment_id="seg-1",
            incarnation=1_700_000_000_000_000,
            domain=directory.FailureDomain(zone="z1", rack="r1", host="h1"),
            capacity_bytes=1 << 30,
            data_addr="tcp://127.0.0.1:7000",
            disk_objects=12,
        ),
    ),
    "seg.report_reply.v1.ssd": (  # a disk tier's object: its slot id is SSD_SLOT_BASE + 5
        "segment",
        segment.SegmentReport(
            incarnation=9,
            capacity_bytes=1 << 30,
            used_bytes=0,
            draining=False,
            objects=[
                segment.HeldObject(ObjectKey(bytes(96)), segment.SSD_SLOT_BASE + 5, 3, 65536, b"k" * 16)
            ],
            next_after_slot=-1,
        ),
    ),
    "dp.put.v1": (
        "dataplane",
        dataplane.PutRequest(
            ticket=directory.WriteTicket(
                ticket_id=5,
                key=ObjectKey(bytes(96)),
                segment_id="s1",
                incarnation=9,
                size_bytes=1 << 20,
                checksum=b"c" * 16,
                writer_id="w",
                deadline_ms=1_000_000,
                epoch=3,
                data_addr="tcp://127.0.0.1:7000",
                signature=b"s" * 32,
            )
        ),
    ),
    "dp.get_reply.v1": (
        "dataplane",
        dataplane.GetReply(
            results=[dataplane.ObjectResult("ok", b"k" * 16), dataplane.ObjectResult("stale_generation", b"")]
        ),
    ),
}

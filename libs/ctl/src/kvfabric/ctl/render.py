"""Output: rich tables for people, JSON documents for scripts (`--json`, bytes as hex)."""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from kvfabric.ctl.keys import group_from_summary
from kvfabric.ctl.queries import Event, ServiceInstance, jsonable
from kvfabric.proto import directory as m
from kvfabric.proto import eviction as e
from kvfabric.proto.segment import SegmentState, tier_of_slot

__all__ = [
    "emit_json",
    "error_line",
    "group_doc",
    "print_drain",
    "print_events",
    "print_eviction_status",
    "print_explain",
    "print_fields",
    "print_groups",
    "print_leases",
    "print_manifest",
    "print_pin",
    "print_status",
    "print_tenants",
    "segment_doc",
]


def _console() -> Console:
    # Built per call: the CLI test runner swaps sys.stdout between invocations.
    # Piped output gets room for a full readable chunk group id on one line.
    # No markup: cells carry tenant-chosen text (holder ids), which rich would parse as markup
    # ("[/]" crashed kvctl, "[link=...]" restyled or hid what the operator sees; review,
    # 2026-12-05).
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 320, markup=False)


def _safe(text: str, *, keep_newlines: bool = False) -> str:
    """Text as the terminal shows it: control characters (ESC, CSI, C1, CR, ...) escaped, never
    sent. Cells carry tenant-chosen text (holder ids), and an escape sequence in one erased or
    rewrote rows, set the window title or wrote the clipboard on the operator's terminal
    (review, stop 68; rich drops only a few control bytes). `keep_newlines`: our own multi-line
    cells (an event's fields, one per line)."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() or (keep_newlines and c == "\n") else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


class _Table(Table):
    """A rich table whose text cells go through `_safe` (newlines kept: see `_safe`)."""

    def add_row(self, *renderables: Any, **kwargs: Any) -> None:
        super().add_row(
            *(_safe(r, keep_newlines=True) if isinstance(r, str) else r for r in renderables), **kwargs
        )


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def error_line(code: str, message: str) -> None:
    sys.stderr.write(f"{code}: {message}\n")


def _ms(stamp_ms: int) -> str:
    if stamp_ms <= 0:
        return "-"
    return datetime.datetime.fromtimestamp(stamp_ms / 1000, datetime.UTC).isoformat(timespec="milliseconds")


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # unreachable


def segment_doc(s: m.SegmentInfo) -> dict[str, Any]:
    doc: dict[str, Any] = jsonable(s)
    doc["state"] = "down" if not s.up else ("draining" if s.draining else "up")
    return doc


def group_doc(g: m.GroupSummary) -> dict[str, Any]:
    doc: dict[str, Any] = jsonable(g)
    gid = group_from_summary(g.namespace, g.chunk_index, g.group)
    doc["chain_hash"] = g.group.hex()
    doc["group_id"] = gid.to_bytes().hex() if gid is not None else ""
    doc["readable"] = str(gid) if gid is not None else ""
    for obj, obj_doc in zip(g.objects, doc.get("objects", []), strict=True):
        for replica, replica_doc in zip(obj.replicas, obj_doc["replicas"], strict=True):
            replica_doc["tier"] = tier_of_slot(replica.slot)  # the slot id says (docs/segment.md)
    return doc


def print_status(segments: Sequence[m.SegmentInfo], services: Sequence[ServiceInstance], epoch: int) -> None:
    console = _console()
    table = _Table(title=f"segments (directory epoch {epoch})")
    for col in (
        "segment",
        "domain",
        "capacity",
        "reserved",
        "used",
        "incarnation",
        "state",
        "last heartbeat",
    ):
        table.add_column(col)
    for s in segments:
        table.add_row(
            s.segment_id,
            f"{s.domain.zone}/{s.domain.rack}/{s.domain.host}",
            _bytes(s.capacity_bytes),
            _bytes(s.reserved_bytes),
            _bytes(s.reported_used_bytes),
            str(s.incarnation),
            segment_doc(s)["state"],
            _ms(s.last_heartbeat_ms),
        )
    console.print(table)
    services_table = _Table(title="services ($SRV.PING)")
    for col in ("name", "id", "version"):
        services_table.add_column(col)
    for svc in services:
        services_table.add_row(svc.name, svc.id, svc.version)
    console.print(services_table)


def print_fields(fields: dict[str, Any]) -> None:
    console = _console()
    table = _Table(title=fields["kind"], show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for name, value in fields.items():
        table.add_row(name, str(value))
    console.print(table)


def print_groups(groups: Sequence[m.GroupSummary]) -> None:
    console = _console()
    table = _Table(title=f"chunk groups ({len(groups)})")
    table.add_column("chunk group", no_wrap=True)
    for col in ("chunk", "state", "members", "degraded", "leases", "pins"):
        table.add_column(col)
    for g in groups:
        doc = group_doc(g)
        table.add_row(
            doc["readable"] or g.group.hex(),
            str(g.chunk_index),
            g.state,
            f"{g.members}/{g.expected_members}",
            "yes" if g.degraded else "no",
            str(g.leases),
            str(g.pins),
        )
    console.print(table)


def print_manifest(g: m.GroupSummary) -> None:
    console = _console()
    doc = group_doc(g)
    console.print(f"chunk group {doc['readable'] or g.group.hex()}", highlight=False)
    console.print(
        f"state {g.state}  chunk {g.chunk_index}  members {g.members}/{g.expected_members}"
        f"  degraded {'yes' if g.degraded else 'no'}  leases {g.leases}  pins {g.pins}",
        highlight=False,
    )
    table = _Table(title="objects")
    for col in ("member (tp.pp.lg)", "size", "checksum", "replicas"):
        table.add_column(col, overflow="fold")
    for obj in g.objects:
        replicas = ", ".join(
            f"{r.segment_id}#{r.incarnation} {tier_of_slot(r.slot)} slot {r.slot} gen {r.slot_generation}"
            for r in obj.replicas
        )
        table.add_row(
            f"{obj.member.tp_rank}.{obj.member.pp_stage}.{obj.member.layer_group}",
            f"{obj.size_bytes} B",
            obj.checksum.hex(),
            replicas or "-",
        )
    console.print(table)


def print_leases(leases: Sequence[m.LeaseInfo]) -> None:
    console = _console()
    table = _Table(title=f"leases and pins ({len(leases)})")
    for col in ("id", "kind", "holder", "groups", "expires"):
        table.add_column(col)
    for lease in leases:
        table.add_row(
            str(lease.lease_id),
            "pin" if lease.is_pin else "lease",
            _safe(lease.holder_id),  # (a tenant's: a newline is escaped too)
            str(lease.groups),
            _ms(lease.expires_ms),
        )
    console.print(table)


def _of(used: int, limit: int, fmt: Callable[[int], str]) -> str:
    if not limit:
        return f"{fmt(used)} / -"
    return f"{fmt(used)} / {fmt(limit)} ({100 * used / limit:.0f}%)"


def print_tenants(tenants: Sequence[m.TenantInfo], default: m.TenantInfo | None) -> None:
    console = _console()
    table = _Table(title=f"tenants ({len(tenants)}); - = unlimited")
    for col in (
        "domain",
        "bytes / quota",
        "objects / quota",
        "rate (req/s, burst)",
        "refused quota",
        "refused rate",
    ):
        table.add_column(col)
    rows = [*tenants, default] if default is not None else tenants
    for t in rows:
        table.add_row(
            t.domain_digest.hex() or "(default)",
            _of(t.used_bytes, t.bytes_max, _bytes),
            _of(t.objects, t.objects_max, str),
            f"{t.requests_per_s:g}, {t.burst}" if t.requests_per_s else "-",
            str(t.quota_exceeded),
            str(t.rate_limited),
        )
    console.print(table)


def print_pin(reply: m.PinReply, added: bool) -> None:
    if added:
        line = f"pin {reply.pin_id}: {reply.pinned_groups} group(s) pinned until {_ms(reply.expires_ms)}"
    else:
        line = f"pin {reply.pin_id} removed"
    _console().print(line, highlight=False)


def print_drain(segment_id: str, state: SegmentState) -> None:
    what = "draining (refuses new writes, serves reads)" if state.draining else "accepting writes"
    _console().print(
        f"segment {segment_id} (incarnation {state.incarnation}) is {what}; used {_bytes(state.used_bytes)}",
        highlight=False,
    )


def event_fields(event: dict[str, Any]) -> str:
    """An event's fields as `k=v` words; a batch's `groups` (a `GroupsPublished` holds up to 256,
    a `GroupsAccessed` up to 4,096) one line each under a count, not one run-on line."""
    words = [f"{k}={v}" for k, v in event.items() if k not in ("t", "groups")]
    groups = event.get("groups")
    if not isinstance(groups, list):
        return " ".join(words)
    lines = [" ".join([*words, f"groups={len(groups)}:"]).strip()]
    for group in groups:
        items = group.items() if isinstance(group, dict) else [("", group)]
        lines.append("  " + " ".join(f"{k}={v}" if k else str(v) for k, v in items))
    return "\n".join(lines)


def print_events(events: Sequence[Event]) -> None:
    console = _console()
    table = _Table(title=f"directory events ({len(events)})")
    for col in ("seq", "time", "kind", "fields"):
        table.add_column(col, overflow="fold")
    for ev in events:
        table.add_row(str(ev.seq), ev.time, ev.kind, event_fields(ev.event))
    console.print(table)


def print_eviction_status(status: e.EvictionStatus) -> None:
    console = _console()
    console.print(
        f"eviction policy {status.policy}: {status.objects} chunk group(s) tracked, "
        f"watermarks {status.high_watermark:.0%} / {status.low_watermark:.0%}, "
        f"{status.events_applied} events applied",
        highlight=False,
    )
    pools = _Table(title=f"pools ({len(status.pools)}); a disk tier is <segment>#ssd")
    for col in ("pool", "used / capacity", "evicting"):
        pools.add_column(col)
    for p in status.pools:
        pools.add_row(p.segment_id, _of(p.used_bytes, p.capacity_bytes, _bytes), _bytes(p.evicting_bytes))
    console.print(pools)
    if status.tenants:
        tenants = _Table(title=f"tenants ({len(status.tenants)}); - = no quota")
        for col in ("domain", "used / hard quota", "guaranteed"):
            tenants.add_column(col)
        for t in status.tenants:
            guaranteed = _bytes(t.guaranteed_bytes) if t.guaranteed_bytes else "-"
            tenants.add_row(t.domain_digest.hex(), _of(t.used_bytes, t.hard_bytes, _bytes), guaranteed)
        console.print(tenants)
    counters = _Table(title="counters (non-zero)", show_header=False)
    counters.add_column("name", style="bold")
    counters.add_column("value")
    for name, value in sorted(status.counters.items()):
        if value:
            counters.add_row(name, str(value))
    console.print(counters)


def _limit_text(limit: int) -> str:
    return "any size" if limit == e.ADMISSION_UNLIMITED else f"up to {_bytes(limit)}"


def print_explain(group: str, reply: e.EvictionExplain) -> None:
    """Why the policy holds, held or dropped one chunk group: its features, decisions, admission."""
    console = _console()
    held = "tracked (resident)" if reply.tracked else "not tracked now"
    console.print(f"chunk group {group}\npolicy {reply.policy}: {held}", highlight=False)
    if reply.features:
        features = _Table(title="what the policy ranks it by", show_header=False)
        features.add_column("feature", style="bold")
        features.add_column("value", overflow="fold")
        for name, value in reply.features.items():
            text = _ms(value) if name.endswith("_ms") and isinstance(value, int) and value > 0 else str(value)
            features.add_row(name, text)
        console.print(features)
    if reply.decisions:
        decisions = _Table(title=f"its latest decisions ({len(reply.decisions)}, oldest first)")
        for col in ("time", "decision", "reason", "pool", "cause"):
            decisions.add_column(col)
        for d in reply.decisions:
            decisions.add_row(_ms(d.at_ms), d.what, d.reason or "-", d.pool or "-", d.cause or "-")
        console.print(decisions)
    elif not reply.decisions_kept:
        console.print("no decisions kept (KVF_EVICTION_DECISIONS_MAX=0)", highlight=False)
    else:
        console.print("no decision about it remembered (never seen, or older than the policy's log)")
    a = reply.admission
    if a is None:
        console.print("admission: no live admission filter (KVF_EVICTION_ADMISSION off, or none built yet)")
        return
    if a.protected or a.seen:
        why = "its share domain is below its guaranteed share" if a.protected else "it was named recently"
        verdict = f"admitted whatever its size: {why}"
    elif not a.limits:
        verdict = "admitted: no pool is past its low watermark"
    else:
        verdict = "if named for the first time: " + "; ".join(
            f"{pool} admits {_limit_text(limit)}" for pool, limit in sorted(a.limits.items())
        )
    console.print(
        f"admission (filter of {_ms(a.generated_ms)}, length class {a.length_class}): {verdict}",
        highlight=False,
    )

"""What every directory table shares: the configuration, the effects a step returns, and the
context each table reads (epoch, shard, counters, ids, tenant quotas) with the checks every verb
makes first (epoch, batch size, request rate). No state machine lives here.

## The context
One `Context` per core, handed to every table: its `epoch` may be raised by the shell between
steps (a new term), its `counters` are plain counts the shell exports, its `ids` number write
tickets, replica tickets, leases and pins from one sequence (an id is never reused by another
table), and its `quotas` hold per-tenant usage every table adjusts at each change of its own
records (`kvfabric.core.quotas`); its `admission` gate holds the eviction policy's latest
admission filter (`kvfabric.core.eviction_admission`), which put_begin consults.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final

import msgspec

from kvfabric.core.directory.replies import ReplySizes
from kvfabric.core.eviction_admission import ADMISSION_STALE_MS_DEFAULT, AdmissionGate
from kvfabric.core.quotas import UNLIMITED, Quotas, Tenant, TenantQuota, tenant_of
from kvfabric.format.errors import BatchTooLarge, RateLimited, StaleGeneration, Unavailable
from kvfabric.format.ids import DOMAIN_SLICE
from kvfabric.proto import directory as m

__all__ = [
    "CHECKSUM_BYTES",
    "GENERATION_MAX",
    "HEAP_SLACK_MIN",
    "LIST_SCAN_GROUPS_MAX",
    "SLOT_MAX",
    "Context",
    "DirectoryConfig",
    "Effect",
    "EmitEvent",
    "FreeSlots",
    "Member",
    "Outcome",
    "Steps",
    "check_batch",
    "run_whole",
    "scope_of",
]

Member = tuple[int, int, int]  # (tp_rank, pp_stage, layer_group)
CHECKSUM_BYTES: Final = 16
SLOT_MAX: Final = 2**32 - 1  # the published record packs slots as u32 ...
GENERATION_MAX: Final = 2**64 - 1  # ... and generations as u64 (a generation starts at 1)
# Groups one `list_groups` call examines at most (its page may hold fewer: filtered, or cut to
# fit the reply): a listing stalls the event loop for O(this), whatever the store holds.
LIST_SCAN_GROUPS_MAX: Final = 1_000
# A deadline heap (leases, writes, replica tickets) keeps an entry after its item ended early;
# once it holds more than twice its live items plus this, it is rebuilt from the live ones.
HEAP_SLACK_MIN: Final = 1_024


def scope_of(holder_id: str) -> str | None:
    """The tenant a holder id was scoped to by the directory shell (`<tenant>/<holder>`), if any."""
    scope, sep, _ = holder_id.partition("/")
    return scope if sep else None


@dataclass(frozen=True, slots=True)
class DirectoryConfig:
    ticket_secret: bytes
    replicas_default: int = 1
    replicas_max: int = 5
    heartbeat_interval_ms: int = 1_000
    heartbeat_timeout_ms: int = 5_000
    object_bytes_max: int = 1 << 30
    pending_objects_max: int = 200_000
    leases_max: int = 200_000
    pins_max: int = 10_000
    # Bounded by the number of per-object results held (an empty reply counts as one), not by
    # replies (a reply may hold 4096).
    reply_cache_objects_max: int = 16_384
    free_retry_ms: int = 2_000
    # Frees resent (unacknowledged past `free_retry_ms`, or held through a grace that ended) at
    # most per tick, oldest first; the rest at the next ticks (`frees`).
    free_resend_batch_max: int = 4_096
    # Groups the sweep examines at most per tick (`published`): a tick stalls for O(this).
    sweep_batch_max: int = 10_000
    # Write members reclaimed past their deadline, and groups named by ended leases and pins, at
    # most per tick (the rest at the next ones): one tenant's 50,000 members written to expire
    # in one tick took 1.2 s of the loop in one call (review, stop 67); ~25 ms now.
    expire_batch_max: int = 1_024
    # Read leases are granted for at most this long (a longer request is shortened). A new leader
    # waits this long (its grace period) before freeing anything, so leases of the old one hold.
    lease_ttl_ms_max: int = 60_000
    # Per-tenant (share domain digest) quotas and request rates; see `kvfabric.core.quotas`.
    tenant_quota_default: TenantQuota = UNLIMITED
    tenant_quotas: Mapping[bytes, TenantQuota] = field(default_factory=dict)
    tenants_max: int = 10_000  # token buckets and rejection counts kept (least recently used go)
    # Leases and pins one authenticated tenant may hold at once (its holder ids are scoped
    # `<tenant>/<holder>` by the directory shell), so no tenant fills the shared tables.
    tenant_leases_max: int = 50_000
    tenant_pins_max: int = 2_500
    # the groups one tenant's leases / pins name in all (each ~90 bytes held: ~23 / ~6 MB)
    tenant_lease_groups_max: int = 262_144
    tenant_pin_groups_max: int = 65_536
    # Per-tenant budgets of the write path (issue 21), for the same scoped writer ids: members
    # being written (building, not yet published), and the bytes they hold reserved (size ×
    # replicas), as a fraction of the capacity of the live segments this core places on (the
    # service divides it by the shard count). Over either, the whole put_begin is `busy`.
    tenant_pending_objects_max: int = 50_000
    tenant_pending_capacity_fraction: float = 0.25
    # A tenant's pins last at most this long (a longer request is shortened; services' pins may
    # ask up to PIN_TTL_MS_MAX).
    tenant_pin_ttl_ms_max: int = 3_600_000
    # Write deadlines are granted for at most this long (a longer request is shortened): what a
    # write needs, the client's save timeout; a dead writer's reservation lasts no longer.
    write_ttl_ms_max: int = 30_000
    # Placement sees a segment's free bytes rounded down to a 1/free_bytes_granules part of its
    # capacity (0 = exact), so which objects fit tells a writer free space only to that grain.
    free_bytes_granules: int = 64
    # The largest encoded reply body: a put_begin whose reply could be larger is refused
    # (`batch_too_large`) before anything is placed (NATS drops a message over max_payload).
    reply_bytes_max: int = m.REPLY_BYTES_MAX
    # Groups one `list_groups` call examines at most (tests lower it to page often).
    list_scan_groups_max: int = LIST_SCAN_GROUPS_MAX
    # True when other shards' cores place on the same segments (a sharded directory): a
    # segment's free space is then its capacity minus the larger of this core's reservations
    # and the usage the segment reports (all shards'; a heartbeat old).
    segments_shared: bool = False
    # The eviction policy's admission filter decides at put_begin only while it arrived at most
    # this long ago (0 = admission off); `kvfabric.core.eviction_admission`.
    admission_stale_ms: int = ADMISSION_STALE_MS_DEFAULT


# ---- effects -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EmitEvent:
    """Publish an event to JetStream (`kvf.v1.events.directory.<kind>`)."""

    kind: str
    event: msgspec.Struct


@dataclass(frozen=True, slots=True)
class FreeSlots:
    """Tell a segment to free these slots. It answers with `SlotsFreed`."""

    segment_id: str
    incarnation: int
    slots: tuple[m.FreedSlot, ...]


Effect = EmitEvent | FreeSlots


@dataclass(slots=True)
class Outcome:
    reply: msgspec.Struct
    effects: list[Effect] = field(default_factory=list)


# A request run in steps (put_begin, put_commit, evict: `DirectoryCore.steps`): each `next()` is
# one bounded stretch of work and yields that stretch's effects; the generator returns the reply.
# The first step runs every whole-request check (a refusal raises there, nothing applied).
Steps = Generator[list[Effect], None, msgspec.Struct]


def run_whole(steps: Steps) -> Outcome:
    """A request's steps run one after another, as one call: its reply and all their effects."""
    effects: list[Effect] = []
    while True:
        try:
            effects += next(steps)
        except StopIteration as done:
            return Outcome(done.value, effects)


# ---- the shared context --------------------------------------------------------------------


class Context:
    """Epoch, shard, counters, ids and quotas: what every table of one core reads."""

    def __init__(self, config: DirectoryConfig, epoch: int, shard: int, first_id: int = 1) -> None:
        self.config = config
        self.epoch = epoch
        self.shard = shard  # the virtual shard this core leads (tickets name it: per-shard fencing)
        self.counters: dict[str, int] = {}
        # ids are fenced by the epoch; a core rebuilt at the same epoch starts them past the old
        # core's (`first_id`), or a late confirm of the old core's ticket N ended the new core's
        # ticket N (review, 2026-12-05)
        self._ids: Iterator[int] = itertools.count(first_id)
        self.quotas = Quotas(
            config.tenant_quota_default, config.tenant_quotas, config.tenants_max, self.count
        )
        self.reply_sizes = ReplySizes.measure(config.ticket_secret)
        self.admission = AdmissionGate(config.admission_stale_ms, self.count)  # put_begin's filter

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def next_id(self) -> int:
        """A new ticket, lease or pin id: one sequence for all of them, never reused."""
        return next(self._ids)

    def check_epoch(self, epoch: int) -> None:
        if epoch and epoch < self.epoch:
            self.count("stale_epoch_rejected_total")
            raise StaleGeneration("directory_epoch", epoch, self.epoch)
        if epoch > self.epoch:
            self.count("future_epoch_rejected_total")
            raise Unavailable(
                f"directory epoch {self.epoch} is behind the caller's {epoch}", epoch=self.epoch
            )

    def check_rate(self, raw_ids: Iterable[bytes], now_ms: int, tokens: int = 1) -> None:
        """Charge one request of `tokens` to the tenants of these keys / chunk group ids (all
        or none; see `quotas.Quotas.charge`)."""
        if not self.quotas.rate_limited:
            return
        wait_ms = self.quotas.charge(map(tenant_of, raw_ids), now_ms, tokens)
        if wait_ms:
            raise RateLimited(
                f"request rate over the tenant's limit; retry in {wait_ms} ms", retry_after_ms=wait_ms
            )

    def check_rate_ahead(self, raw_ids: Iterable[bytes], now_ms: int, tokens: int = 1) -> None:
        """`check_rate`'s refusal, before a request's per-id work, taking nothing: a tenant out of
        tokens sent put_begins of ~1,900 fresh keys, each parsed and checked (~14 ms of the
        shard's loop) before `check_rate` refused it (review, stop 68). Ids too short to name a
        tenant are left to the parse's refusal."""
        if not self.quotas.rate_limited:
            return
        tenants = (tenant_of(raw) for raw in raw_ids if len(raw) >= DOMAIN_SLICE.stop)
        wait_ms = self.quotas.wait_ms(tenants, now_ms, tokens)
        if wait_ms:
            raise RateLimited(
                f"request rate over the tenant's limit; retry in {wait_ms} ms", retry_after_ms=wait_ms
            )

    def charge_domains(self, domain_digests: Iterable[bytes], now_ms: int) -> None:
        """Charge one request to these share domains' rate limits; raises `RateLimited` and
        charges nothing when one is out of tokens."""
        wait_ms = self.quotas.charge((Tenant(d) for d in domain_digests), now_ms)
        if wait_ms:
            raise RateLimited(
                f"request rate over the tenant's limit; retry in {wait_ms} ms", retry_after_ms=wait_ms
            )


def check_batch(what: str, n: int, limit: int) -> None:
    if n > limit:
        raise BatchTooLarge(f"{what}: {n} items exceed the limit of {limit}", n=n, limit=limit)

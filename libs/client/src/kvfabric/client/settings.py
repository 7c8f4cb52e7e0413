"""Client settings: where the cluster is, who the engine is, and every limit, named with its unit.

Limits (docs/design.md 3.6): a client never grows without bound. Loads beyond `transfers_max` or
`load_inflight_bytes_max` are answered Busy (the engine recomputes), saves beyond
`save_inflight_bytes_max` or `saves_queued_max` are dropped and counted (the engine never waits), and
saves over `save_bytes_per_s_max` keep only their leading chunks the rate covers.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import msgspec

from kvfabric.client.threads import parse_cpu_list
from kvfabric.cluster.natsauth import NatsAuth
from kvfabric.format.errors import BadRequest
from kvfabric.format.key import ShareDomain
from kvfabric.proto.directory import LEASE_TTL_MS_MAX, WRITE_TTL_MS_MAX
from kvfabric.proto.subjects import check_tenant, tenant_inbox_prefix

__all__ = ["ClientSettings", "settings_from_env"]

ENV_PREFIX: Final = "KVF_CLIENT_"


class ClientSettings(msgspec.Struct, frozen=True, kw_only=True):
    # NATS: one URL, or the servers of one NATS cluster as a comma list of URLs (each with its
    # scheme), which the connection fails over between (`kvfabric.cluster.natsauth.nats_servers`).
    nats_url: str
    tenant_id: str = "default"
    # The share domain's salt (hex). Engines that must not share KV use different salts.
    domain_salt_hex: str = "6b7666616272696364656661756c7400"
    # Authenticated NATS tenant (docs/security.md): when set, requests go to the tenant's own
    # subjects and replies come back under its own inbox; the directory then allows only the
    # share domains granted to it. Empty: service subjects (a development cluster without auth).
    nats_tenant: str = ""
    nats_user: str = ""
    nats_password: str = ""
    nats_password_file: str = ""
    nats_tls_ca: str = ""  # set: TLS to NATS, server verified against this CA bundle
    nats_tls_cert: str = ""
    nats_tls_key: str = ""
    data_tls_ca: str = ""  # set: read segments that serve tls://, verified against this CA bundle
    holder_id: str = msgspec.field(default_factory=lambda: f"client-{uuid.uuid4().hex[:12]}")
    lookup_timeout_ms: int = 2_000
    load_timeout_ms: int = 10_000
    save_timeout_ms: int = 30_000
    connect_timeout_ms: int = 2_000
    lease_ttl_ms: int = 30_000
    write_ttl_ms: int = 30_000
    transfers_max: int = 16  # concurrent object transfers (threads)
    connections_per_segment_max: int = 8  # in use or idle, per segment (more transfers wait)
    load_inflight_bytes_max: int = 512 << 20
    save_inflight_bytes_max: int = 512 << 20
    saves_queued_max: int = 64
    # Save bytes per second this client (one engine) may start, 0: no limit. A save over it keeps
    # its leading chunks the budget covers and skips the rest (`save_rate`): after a cache is lost
    # every engine saves all it computes, and this bounds the refill (kvfabric.client.save_rate).
    save_bytes_per_s_max: int = 0
    save_burst_bytes: int = 0  # bytes saved at once before the rate applies; 0: one second's
    replica_attempts_max: int = 2  # replicas tried per object before the load gives up
    # A replica read that is not the last one tried gets this share of what is left of the load's
    # deadline, at least `replica_attempt_min_ms` (never more than is left), then the next replica
    # is tried inside the same load: a slow replica costs part of the deadline, not all of it.
    # The last replica gets all that is left. 100: no per-attempt budget (the first read may use
    # the whole deadline).
    replica_attempt_share_pct: int = 50
    replica_attempt_min_ms: int = 100
    use_shm: bool = True  # read co-located segments through their shared-memory arena
    # Local reads through the segment's slot board: no round trip, a free during the copy is
    # detected (seqlock). False: each local read pins its slots through the segment first.
    local_reads_lockfree: bool = True
    # Comma-separated ids of the segments on this host: their replicas are read first (and, when
    # set, only they through shared memory). Prefetch hints name one of them as the target.
    local_segments: str = ""
    metrics_port: int = -1  # -1: no HTTP endpoint; 0: any free port
    metrics_host: str = "127.0.0.1"  # the address it listens on ("0.0.0.0": every one)
    # CPUs of the client's threads (loop, transfers, saves); kvfabric.client.threads: "" or
    # "inherit" (the creating thread's), "auto" (when it is pinned, e.g. an engine's compute
    # thread: saves off its CPUs, loads anywhere), or "2-3,6".
    thread_cpus: str = ""
    # Test switch only (chaos checkers must be able to fail): loads skip checksum verification.
    unsafe_skip_verification_for_tests: bool = False

    def __post_init__(self) -> None:
        for name in (
            "lookup_timeout_ms",
            "load_timeout_ms",
            "save_timeout_ms",
            "connect_timeout_ms",
            "lease_ttl_ms",
            "write_ttl_ms",
            "transfers_max",
            "connections_per_segment_max",
            "load_inflight_bytes_max",
            "save_inflight_bytes_max",
            "saves_queued_max",
            "replica_attempts_max",
            "replica_attempt_min_ms",
        ):
            if getattr(self, name) < 1:
                raise BadRequest(f"client setting {name} must be at least 1, got {getattr(self, name)}")
        # what the directory takes: a lease or write TTL past it made every lookup (or save) a
        # `bad_request` miss with the client enabled, no config_error (review, stop 68)
        for name, most in (("lease_ttl_ms", LEASE_TTL_MS_MAX), ("write_ttl_ms", WRITE_TTL_MS_MAX)):
            if getattr(self, name) > most:
                raise BadRequest(f"client setting {name} must be at most {most}, got {getattr(self, name)}")
        if not self.metrics_host.strip():
            raise BadRequest("client setting metrics_host must not be empty")
        for name in ("save_bytes_per_s_max", "save_burst_bytes"):
            if getattr(self, name) < 0:
                raise BadRequest(f"client setting {name} must be at least 0, got {getattr(self, name)}")
        if not 1 <= self.replica_attempt_share_pct <= 100:
            share = self.replica_attempt_share_pct
            raise BadRequest(f"client setting replica_attempt_share_pct must be 1..100, got {share}")
        try:
            salt = bytes.fromhex(self.domain_salt_hex)
        except ValueError:
            raise BadRequest("client setting domain_salt_hex is not hex") from None
        if self.nats_tenant:
            try:
                check_tenant(self.nats_tenant)
            except ValueError as exc:
                raise BadRequest(f"client setting nats_tenant: {exc}") from None
        if self.thread_cpus.strip() not in ("", "inherit", "auto"):
            parse_cpu_list(self.thread_cpus)  # BadRequest when it is not a CPU list
        if not 16 <= len(salt) <= 64:
            raise BadRequest(f"domain salt must be 16..64 bytes, got {len(salt)}")

    def nats_auth(self) -> NatsAuth:
        """How to connect: credentials, TLS, and the tenant's inbox prefix."""
        password = self.nats_password
        if self.nats_password_file:
            try:
                password = Path(self.nats_password_file).read_text().strip()
            except OSError as exc:
                raise BadRequest(f"cannot read nats_password_file: {exc}") from None
        return NatsAuth(
            user=self.nats_user,
            password=password,
            tls_ca=self.nats_tls_ca,
            tls_cert=self.nats_tls_cert,
            tls_key=self.nats_tls_key,
            inbox_prefix=tenant_inbox_prefix(self.nats_tenant) if self.nats_tenant else "",
        )

    @property
    def domain_salt(self) -> bytes:
        return bytes.fromhex(self.domain_salt_hex)

    def share_domain(self) -> ShareDomain:
        """The share domain these settings name (`tenant_id` + salt): what keys are salted with."""
        return ShareDomain(self.tenant_id, self.domain_salt)


def settings_from_env(environ: Mapping[str, str] | None = None, **overrides: object) -> ClientSettings:
    """Settings from `KVF_CLIENT_<NAME>` variables (e.g. KVF_CLIENT_NATS_URL) of `environ`
    (default: the process environment, e.g. a tenant's env file from `kvctl auth init`), then
    `overrides`."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for field in msgspec.structs.fields(ClientSettings):
        raw = environ.get(ENV_PREFIX + field.name.upper())
        if raw is None:
            continue
        if field.type is int:
            try:
                values[field.name] = int(raw)
            except ValueError:
                raise BadRequest(f"{ENV_PREFIX}{field.name.upper()} is not an integer: {raw!r}") from None
        elif field.type is bool:
            values[field.name] = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            values[field.name] = raw
    values.update(overrides)
    if "nats_url" not in values:
        raise BadRequest(f"no NATS url: set {ENV_PREFIX}NATS_URL")
    try:
        return msgspec.convert(values, ClientSettings)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"bad client settings: {exc}") from None

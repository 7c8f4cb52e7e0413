"""Segment settings from the environment (the runtime's shared flags come from `kvfabric.runtime`).

| variable | default | meaning |
|---|---|---|
| `KVF_SEGMENT_ID` | required | `[A-Za-z0-9][A-Za-z0-9_-]{0,63}`; appears in subjects |
| `KVF_SEGMENT_BYTES` | 1 GiB | arena size (rounded down to 64 bytes) |
| `KVF_SEGMENT_SHM_DIR` | `/dev/shm` | where the arena file lives (co-located clients map it) |
| `KVF_SEGMENT_DATA_HOST` / `KVF_SEGMENT_DATA_PORT` | 127.0.0.1 / 0 (free port) | TCP data plane |
| `KVF_SEGMENT_ZONE` / `_RACK` / `_HOST` | zone0 / rack0 / hostname | failure domain |
| `KVF_SEGMENT_CONNECTIONS_MAX` | 64 | authenticated data connections per transport; more: busy |
| `KVF_SEGMENT_CONNECTIONS_PER_SOURCE_MAX` | half of the above | of those, from one peer address |
| `KVF_SEGMENT_UNAUTH_CONNECTIONS_MAX` | 64 | not yet authenticated; past it the oldest is closed |
| `KVF_SEGMENT_UNAUTH_CONNECTIONS_PER_SOURCE_MAX` | 16 | of those, from one peer address (same rule) |
| `KVF_SEGMENT_AUTH_DEADLINE_MS` | 1000 | from accept to a valid credential (token or ticket), else closed |
| `KVF_SEGMENT_IDLE_TIMEOUT_MS` | 300000 | an authenticated connection between requests |
| `KVF_SEGMENT_FRAME_TIMEOUT_MS` | 10000 | a request's header + meta, from its first byte |
| `KVF_SEGMENT_TRANSFER_RATE_MIN_BYTES_PER_S` | 1 MiB | a payload: frame timeout + size at this rate |
| `KVF_SEGMENT_UCX` / `KVF_SEGMENT_UCX_PORT` | 0 / 0 | 1: also serve UCX (docs/ucx.md: trusted nets only) |
| `KVF_SEGMENT_TLS_CERT` / `_KEY` / `_CA` | unset | data plane over TLS only (tls://, UCX off); CA for peers |
| `KVF_SEGMENT_READ_TOKENS_REQUIRED` | 1 | serve reads only with the directory's read token |
| `KVF_CLUSTER_SECRET` | required, ≥ 16 bytes | verifies the directory's write tickets |
| `KVF_CLOCK_SKEW_TOLERANCE_MS` | 5000 | token/ticket expiries honoured this long past (clock skew); ≤ 10000 |
| `KVF_SEGMENT_CONFIRM_TIMEOUT_MS` | 5000 | wait for the directory to accept a stored replica |
| `KVF_SEGMENT_COPIES_MAX` | 4 | `copy` requests running at once; more are answered busy |
| `KVF_SEGMENT_COPY_TIMEOUT_MS` | 30000 | one copy's read from its source segment, overall |
| `KVF_SEGMENT_SCRUB_BYTES_PER_S` | 64 MiB | re-verify stored checksums at this rate; 0 disables |
| `KVF_SEGMENT_SCRUB_PASS_MIN_MS` | 60000 | start a scrub pass over all objects at most this often |
| `KVF_SEGMENT_SSD_PATH` | unset (no disk tier) | folder of the disk tier file `kvf-<segment id>.ssd` |
| `KVF_SEGMENT_SSD_BYTES` | 0 | disk tier data bytes (rounded down to 4 KiB); required with the path |
| `KVF_SEGMENT_SSD_SLOTS_MAX` | one per 64 KiB | disk slot ids (index records of 512 B each) |
| `KVF_SEGMENT_SSD_DIRECT` | 1 | `O_DIRECT` data I/O (no page cache); 0: buffered |
| `KVF_SEGMENT_SSD_IO_THREADS` | 4 | I/O engine threads (0: on the calling thread) |
| `KVF_SEGMENT_SSD_IO_QUEUE_MAX` | 256 | I/O pieces queued or running; more: busy |
| `KVF_SEGMENT_SSD_IO_CHUNK_BYTES` | 1 MiB | an object's I/O is cut into pieces of this size |
| `KVF_SEGMENT_SSD_STREAM_HEAD_DIVISOR` | 1 (off) | N > 1: a lone disk object's 1/N head sent, the rest read |
| `KVF_SEGMENT_SSD_READ_BYTES_MAX` | 256 MiB | buffers of disk reads held at once; more: busy |
| `KVF_SEGMENT_SSD_VERIFY_ON_START` | 0 | re-hash every recovered object before serving |
| `KVF_SEGMENT_DEMOTE_YIELD_MS` | 20 | a demotion step waits at most this while a GET is served; 0: never |
| `KVF_SEGMENT_GIL_SWITCH_US` | 500 | the process's GIL switch interval (Python's default: 5000) |
| `KVF_SEGMENT_CONFIRM_LATER_GATHER_MS` | 200 | receipted writes queue this long, then confirm together |
| `KVF_SEGMENT_ARENA_PREFAULT` | 1 | fault the arena in at start (a low-priority thread); 0: on first use |
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvfabric.core.disk_records import BLOCK_BYTES as SSD_BLOCK_BYTES
from kvfabric.core.segment_slots import ALIGNMENT_DEFAULT as ARENA_ALIGN
from kvfabric.dataplane.admission import (
    AUTH_DEADLINE_MS_DEFAULT,
    FRAME_TIMEOUT_MS_DEFAULT,
    IDLE_TIMEOUT_MS_DEFAULT,
    TRANSFER_RATE_MIN_BYTES_PER_S_DEFAULT,
    UNAUTHENTICATED_MAX_DEFAULT,
    UNAUTHENTICATED_PER_SOURCE_MAX_DEFAULT,
    ConnectionLimits,
)
from kvfabric.proto.subjects import check_segment_id
from kvfabric.proto.tickets import SECRET_BYTES_MIN
from kvfabric.runtime.config import SettingsError, env_int
from kvfabric.segment_storage.backend import (
    CLOCK_SKEW_TOLERANCE_MS_DEFAULT,
    CLOCK_SKEW_TOLERANCE_MS_MAX,
    DEMOTE_YIELD_MS_DEFAULT,
)
from kvfabric.segment_storage.ssd_io import STREAM_HEAD_DIVISOR_DEFAULT

__all__ = ["SegmentSettings", "load_segment_settings"]

SSD_BYTES_PER_SLOT_DEFAULT: Final = 64 << 10  # disk slot ids by default: one per 64 KiB of data
SSD_SLOTS_MIN: Final = 64
SSD_SLOTS_MAX: Final = 1 << 24

# KVF_SEGMENT_CONFIRM_LATER_GATHER_MS: how long receipted writes wait on their queue before the
# loop confirms them together (`shell_confirms`; 0: at once).
CONFIRM_LATER_GATHER_MS_DEFAULT: Final = 200
GIL_SWITCH_US_DEFAULT: Final = 500  # KVF_SEGMENT_GIL_SWITCH_US (Python's own default: 5000)


@dataclass(frozen=True, kw_only=True)
class SegmentSettings:
    segment_id: str
    arena_bytes: int
    shm_dir: Path
    data_host: str
    data_port: int
    zone: str
    rack: str
    host: str
    connections_max: int
    secret: bytes
    confirm_timeout_ms: int
    ucx: bool = True
    ucx_port: int = 0
    copies_max: int = 4
    copy_timeout_ms: int = 30_000
    scrub_bytes_per_s: int = 64 << 20
    scrub_pass_min_ms: int = 60_000
    read_tokens_required: bool = True
    clock_skew_tolerance_ms: int = CLOCK_SKEW_TOLERANCE_MS_DEFAULT  # see ArenaBackend (clocks)
    tls_cert: str = ""  # set (with tls_key): serve the data plane over TLS only (tls://, no UCX)
    tls_key: str = ""
    tls_ca: str = ""  # verifies other segments' certificates when copying from them
    # Data plane before authentication (kvfabric.dataplane.admission); 0 = half of connections_max.
    connections_per_source_max: int = 0
    unauthenticated_max: int = UNAUTHENTICATED_MAX_DEFAULT
    unauthenticated_per_source_max: int = UNAUTHENTICATED_PER_SOURCE_MAX_DEFAULT
    auth_deadline_ms: int = AUTH_DEADLINE_MS_DEFAULT
    idle_timeout_ms: int = IDLE_TIMEOUT_MS_DEFAULT
    frame_timeout_ms: int = FRAME_TIMEOUT_MS_DEFAULT
    transfer_rate_min_bytes_per_s: int = TRANSFER_RATE_MIN_BYTES_PER_S_DEFAULT
    # The disk tier (kvfabric.segment_storage.ssd); off while ssd_dir is None.
    ssd_dir: Path | None = None
    ssd_bytes: int = 0
    ssd_slots_max: int = 0
    ssd_direct: bool = True
    ssd_io_threads: int = 4
    ssd_io_queue_max: int = 256
    ssd_io_chunk_bytes: int = 1 << 20
    ssd_stream_head_divisor: int = STREAM_HEAD_DIVISOR_DEFAULT
    ssd_read_bytes_max: int = 256 << 20
    ssd_verify_on_start: bool = False
    demote_yield_ms: int = DEMOTE_YIELD_MS_DEFAULT
    gil_switch_us: int = GIL_SWITCH_US_DEFAULT
    confirm_later_gather_ms: int = CONFIRM_LATER_GATHER_MS_DEFAULT
    arena_prefault: bool = True  # fault the arena's pages in at start (arena.py: Prefault)

    @property
    def connection_limits(self) -> ConnectionLimits:
        """The bounds every data-plane transport of this segment applies (each on its own)."""
        return ConnectionLimits(
            connections_max=self.connections_max,
            connections_per_source_max=self.connections_per_source_max or max(1, self.connections_max // 2),
            unauthenticated_max=self.unauthenticated_max,
            unauthenticated_per_source_max=self.unauthenticated_per_source_max,
            auth_deadline_ms=self.auth_deadline_ms,
            idle_timeout_ms=self.idle_timeout_ms,
            frame_timeout_ms=self.frame_timeout_ms,
            transfer_rate_min_bytes_per_s=self.transfer_rate_min_bytes_per_s,
        )


def load_segment_settings(env: Mapping[str, str]) -> SegmentSettings:
    try:
        segment_id = check_segment_id(env.get("KVF_SEGMENT_ID", ""))
    except ValueError as exc:
        raise SettingsError(f"KVF_SEGMENT_ID: {exc}") from None
    secret = env.get("KVF_CLUSTER_SECRET", "").encode()
    if len(secret) < SECRET_BYTES_MIN:
        raise SettingsError(f"KVF_CLUSTER_SECRET must be set to at least {SECRET_BYTES_MIN} bytes")
    ssd_path = env.get("KVF_SEGMENT_SSD_PATH", "")
    ssd_bytes = env_int(env, "KVF_SEGMENT_SSD_BYTES", 0, 0, 1 << 50) // SSD_BLOCK_BYTES * SSD_BLOCK_BYTES
    if bool(ssd_path) != bool(ssd_bytes):
        raise SettingsError(
            "KVF_SEGMENT_SSD_PATH and KVF_SEGMENT_SSD_BYTES (>= 4 KiB) go together: set both or neither"
        )
    ssd_slots_default = min(SSD_SLOTS_MAX, max(SSD_SLOTS_MIN, ssd_bytes // SSD_BYTES_PER_SLOT_DEFAULT))
    return SegmentSettings(
        segment_id=segment_id,
        # rounded down to the slot table's alignment: one that is not a multiple passed here and
        # the start crashed with an invariant traceback, its new arena files left (review, stop 68)
        arena_bytes=env_int(env, "KVF_SEGMENT_BYTES", 1 << 30, 1 << 20, 1 << 46) // ARENA_ALIGN * ARENA_ALIGN,
        shm_dir=Path(env.get("KVF_SEGMENT_SHM_DIR") or "/dev/shm"),
        data_host=env.get("KVF_SEGMENT_DATA_HOST") or "127.0.0.1",
        data_port=env_int(env, "KVF_SEGMENT_DATA_PORT", 0, 0, 65535),
        zone=env.get("KVF_SEGMENT_ZONE") or "zone0",
        rack=env.get("KVF_SEGMENT_RACK") or "rack0",
        host=env.get("KVF_SEGMENT_HOST") or socket.gethostname(),
        connections_max=env_int(env, "KVF_SEGMENT_CONNECTIONS_MAX", 64, 1, 4096),
        secret=secret,
        confirm_timeout_ms=env_int(env, "KVF_SEGMENT_CONFIRM_TIMEOUT_MS", 5_000, 10, 600_000),
        ucx=bool(env_int(env, "KVF_SEGMENT_UCX", 0, 0, 1)),
        ucx_port=env_int(env, "KVF_SEGMENT_UCX_PORT", 0, 0, 65535),
        copies_max=env_int(env, "KVF_SEGMENT_COPIES_MAX", 4, 1, 64),
        copy_timeout_ms=env_int(env, "KVF_SEGMENT_COPY_TIMEOUT_MS", 30_000, 100, 600_000),
        scrub_bytes_per_s=env_int(env, "KVF_SEGMENT_SCRUB_BYTES_PER_S", 64 << 20, 0, 1 << 40),
        scrub_pass_min_ms=env_int(env, "KVF_SEGMENT_SCRUB_PASS_MIN_MS", 60_000, 0, 86_400_000),
        read_tokens_required=bool(env_int(env, "KVF_SEGMENT_READ_TOKENS_REQUIRED", 1, 0, 1)),
        clock_skew_tolerance_ms=env_int(
            env,
            "KVF_CLOCK_SKEW_TOLERANCE_MS",
            CLOCK_SKEW_TOLERANCE_MS_DEFAULT,
            0,
            CLOCK_SKEW_TOLERANCE_MS_MAX,
        ),
        tls_cert=env.get("KVF_SEGMENT_TLS_CERT", ""),
        tls_key=env.get("KVF_SEGMENT_TLS_KEY", ""),
        tls_ca=env.get("KVF_SEGMENT_TLS_CA", ""),
        connections_per_source_max=env_int(env, "KVF_SEGMENT_CONNECTIONS_PER_SOURCE_MAX", 0, 0, 4096),
        unauthenticated_max=env_int(
            env, "KVF_SEGMENT_UNAUTH_CONNECTIONS_MAX", UNAUTHENTICATED_MAX_DEFAULT, 1, 4096
        ),
        unauthenticated_per_source_max=env_int(
            env,
            "KVF_SEGMENT_UNAUTH_CONNECTIONS_PER_SOURCE_MAX",
            UNAUTHENTICATED_PER_SOURCE_MAX_DEFAULT,
            1,
            4096,
        ),
        auth_deadline_ms=env_int(env, "KVF_SEGMENT_AUTH_DEADLINE_MS", AUTH_DEADLINE_MS_DEFAULT, 10, 60_000),
        idle_timeout_ms=env_int(env, "KVF_SEGMENT_IDLE_TIMEOUT_MS", IDLE_TIMEOUT_MS_DEFAULT, 100, 86_400_000),
        frame_timeout_ms=env_int(env, "KVF_SEGMENT_FRAME_TIMEOUT_MS", FRAME_TIMEOUT_MS_DEFAULT, 10, 600_000),
        transfer_rate_min_bytes_per_s=env_int(
            env,
            "KVF_SEGMENT_TRANSFER_RATE_MIN_BYTES_PER_S",
            TRANSFER_RATE_MIN_BYTES_PER_S_DEFAULT,
            1,
            1 << 40,
        ),
        ssd_dir=Path(ssd_path) if ssd_path else None,
        ssd_bytes=ssd_bytes,
        ssd_slots_max=env_int(
            env, "KVF_SEGMENT_SSD_SLOTS_MAX", ssd_slots_default, SSD_SLOTS_MIN, SSD_SLOTS_MAX
        ),
        ssd_direct=bool(env_int(env, "KVF_SEGMENT_SSD_DIRECT", 1, 0, 1)),
        ssd_io_threads=env_int(env, "KVF_SEGMENT_SSD_IO_THREADS", 4, 0, 64),
        ssd_io_queue_max=env_int(env, "KVF_SEGMENT_SSD_IO_QUEUE_MAX", 256, 1, 1 << 16),
        ssd_io_chunk_bytes=env_int(env, "KVF_SEGMENT_SSD_IO_CHUNK_BYTES", 1 << 20, SSD_BLOCK_BYTES, 1 << 30)
        // SSD_BLOCK_BYTES
        * SSD_BLOCK_BYTES,
        ssd_stream_head_divisor=env_int(
            env, "KVF_SEGMENT_SSD_STREAM_HEAD_DIVISOR", STREAM_HEAD_DIVISOR_DEFAULT, 1, 64
        ),
        ssd_read_bytes_max=env_int(env, "KVF_SEGMENT_SSD_READ_BYTES_MAX", 256 << 20, 1 << 20, 1 << 40),
        ssd_verify_on_start=bool(env_int(env, "KVF_SEGMENT_SSD_VERIFY_ON_START", 0, 0, 1)),
        demote_yield_ms=env_int(env, "KVF_SEGMENT_DEMOTE_YIELD_MS", DEMOTE_YIELD_MS_DEFAULT, 0, 10_000),
        gil_switch_us=env_int(env, "KVF_SEGMENT_GIL_SWITCH_US", GIL_SWITCH_US_DEFAULT, 50, 100_000),
        confirm_later_gather_ms=env_int(
            env, "KVF_SEGMENT_CONFIRM_LATER_GATHER_MS", CONFIRM_LATER_GATHER_MS_DEFAULT, 0, 5_000
        ),
        arena_prefault=bool(env_int(env, "KVF_SEGMENT_ARENA_PREFAULT", 1, 0, 1)),
    )


def apply_process_settings(settings: SegmentSettings) -> None:
    """What the segment sets for its whole process at start: the GIL switch interval. A thread
    that returns from a syscall (a GET's send) needs the GIL back; while another thread runs
    Python code (the demoter, the NATS loop) it waits for the holder's switch interval, 5 ms by
    default: a DRAM GET's p99 paid it during demotion (docs/ssd-tier.md "Figures")."""
    sys.setswitchinterval(settings.gil_switch_us / 1e6)

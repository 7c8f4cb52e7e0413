"""Recreate the directory's leader-lease (and member) bucket when nats-server says its store keeps
a write error (a full disk: docs/chaos.md, "A full JetStream disk"). Opt-in: it needs
nats-server's monitoring URL (`KVF_DIRECTORY_NATS_MONITOR_URL`); without it the runbook's
nats-server restart is the only cure.

nats-server 2.15.1 keeps the first I/O error of a stream's store for the store's life (see
`kvfabric.directory.events`): a lease bucket whose append failed with ENOSPC refuses every later
renewal and acquisition, so every shard's lease lapses and nobody can lead again. Deleting the
bucket's stream and adding it again with `first_seq` = its last sequence + 1 clears that, and
keeps epochs (revisions) growing. It is safe when all of these hold, which `check_once` checks:

1. **Certainty that nothing can land**: nats-server's own `/healthz?details=true` names the
   stream with a kept write error (`HealthzError`, server/monitor.go): from then on no append to
   it succeeds, so no lease is renewed or won in it.
2. **Every holder has stopped**: the error was first seen `lease_ttl_ms` + `TTL_MARGIN_S` ago.
   Every term ends at `sent_ms` of its last successful write + `lease_ttl_ms - safety_margin_ms`,
   and that write landed before the error (which was before it was first seen), so every term
   ended before the repair (the margin covers clock-rate drift over one TTL).
3. **One repairer per stuck stream**: a JetStream delete is not conditional, so two instances
   repairing at once could delete the bucket another just re-made, in which a third already won
   a lease (two leaders). Each stuck incarnation is claimed first with a `create` (compare and
   set) of key `repair-<stream>-<created ns>` in the config bucket (`KVF_DIRECTORY_CONFIG`,
   written once at a cluster's first start): only the instance whose create wins repairs; a
   config bucket that cannot be written means no repair.
4. **Still stuck right before the delete**: `/healthz` is read again and the stream's `created`
   and last sequence must be the ones claimed (a nats-server restarted meanwhile has cleared the
   error: then nothing is deleted).
5. **The disk takes writes again**: a scratch stream of this instance takes a message before
   anything else is written (the claim in the config bucket would otherwise catch the full disk
   itself, and the add after the delete could fail); nothing is claimed or deleted before.
6. **Never a bucket without its floor**: the claim's value is the `first_seq` the new bucket must
   start at. If the add after the delete fails, the claimant adds it again at every check, and
   an instance that starts meanwhile and finds the bucket missing creates it from the highest
   claimed `first_seq` (`floor_of`, used by `kvfabric.directory.kv_buckets.open_bucket`), never from 1
   (which would hand out epochs already used).

Counted: `recreated`, `claims_lost` (another instance repaired), `failed`, `check_failures`
(a check that raised: logged `kv_doctor_check_failed` at its first, then at most every
`CHECK_FAILED_LOG_S` while it fails the same way; the next check runs `POLL_S` later whatever
it raised).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Final

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from kvfabric.directory.kv_keys import bucket_keys
from kvfabric.runtime.logs import get_logger

__all__ = [
    "KvDoctor",
    "add_or_find_stream",
    "floor_of",
    "kv_stream_config",
    "stream_write_errors",
]

POLL_S: Final = 2.0  # /healthz read this often
TTL_MARGIN_S: Final = 1.0  # on top of the lease TTL before a stuck lease bucket is recreated
HEALTHZ_TIMEOUT_S: Final = 2.0
API_TIMEOUT_S: Final = 5.0
PROBE_BYTES: Final = 64 << 10  # the scratch write that shows the store takes writes again
CHECK_FAILED_LOG_S: Final = 60.0  # a check failing the same way is logged again this often

Fetch = Callable[[str], Awaitable[dict[str, str]]]
CLAIM_PREFIX: Final = "repair-"


def claim_key(stream: str, created_ns: int) -> str:
    return f"{CLAIM_PREFIX}{stream}-{created_ns}"


def kv_stream_config(bucket: str, ttl_s: float | None, replicas: int, first_seq: int) -> StreamConfig:
    """The stream of a KV bucket as nats-py's `create_key_value` makes it (history 1, file
    storage), starting at `first_seq`."""
    window = 120.0 if not ttl_s or ttl_s >= 120.0 else ttl_s
    return StreamConfig(
        name=f"KV_{bucket}",
        subjects=[f"$KV.{bucket}.>"],
        allow_direct=True,
        allow_rollup_hdrs=True,
        allow_msg_ttl=True,
        deny_delete=True,
        discard=DiscardPolicy.NEW,
        duplicate_window=window,
        max_age=ttl_s,
        max_msgs=-1,
        max_consumers=-1,
        max_msgs_per_subject=1,
        num_replicas=replicas,
        storage=StorageType.FILE,
        first_seq=first_seq,
    )


async def add_or_find_stream(js: nats.js.JetStreamContext, config: StreamConfig) -> bool:
    """Add the stream; True when this call added it, False when it already existed (added
    meanwhile by another instance). A refusal for another reason (a forming cluster without
    enough peers, a bad configuration) is raised: `BadRequestError` alone does not say "exists"."""
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError:
        await js.stream_info(config.name or "")  # NotFoundError (raised) when it is not there
        return False
    return True


async def floor_of(nc: NatsClient, stream: str, config_bucket: str) -> int | None:
    """The highest `first_seq` claimed for a repair of `stream` (None: never repaired, or no
    config bucket yet): a missing bucket must be created from there, not from 1."""
    js = nc.jetstream(timeout=API_TIMEOUT_S)
    try:
        config = await js.key_value(config_bucket)
    except nats.js.errors.BucketNotFoundError:
        return None
    keys = await bucket_keys(js, config_bucket)  # not `config.keys()`: it can end early (kv_keys)
    floors = []
    for key in keys:
        if key.startswith(f"{CLAIM_PREFIX}{stream}-"):
            entry = await config.get(key)
            floors.append(int((entry.value or b"0").split()[0]))
    return max(floors) if floors else None


def _read_healthz(monitor_url: str) -> dict[str, str]:
    url = f"{monitor_url.rstrip('/')}/healthz?details=true"
    try:
        with urllib.request.urlopen(url, timeout=HEALTHZ_TIMEOUT_S) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as err:  # 503 with the errors
        body = json.loads(err.read() or b"{}")
    errors = body.get("errors") or []
    return {
        str(e.get("stream")): str(e.get("error", ""))
        for e in errors
        if isinstance(e, dict) and e.get("stream") and "write error" in str(e.get("error", ""))
    }


async def stream_write_errors(monitor_url: str) -> dict[str, str]:
    """stream name -> nats-server's kept write error, from `/healthz?details=true`."""
    return await asyncio.to_thread(_read_healthz, monitor_url)


class KvDoctor:
    """Watches `/healthz` for the named buckets' streams and recreates a stuck one (module doc)."""

    def __init__(
        self,
        nc: NatsClient,
        monitor_url: str,
        instance_id: str,
        waits_s: dict[str, float],
        *,
        config_bucket: str,
        fetch: Fetch = stream_write_errors,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc = nc
        self.monitor_url = monitor_url
        self.instance_id = instance_id
        self.waits_s = waits_s  # stream -> how long after its error is first seen it may be recreated
        self.config_bucket = config_bucket
        self.fetch = fetch
        self.clock = clock
        self.first_seen: dict[str, float] = {}
        self._pending: dict[str, StreamConfig] = {}  # deleted by this instance, not added back yet
        self.recreated = 0
        self.claims_lost = 0
        self.failed = 0
        self.check_failures = 0
        self._failing: tuple[str, float, int] | None = None  # (error type, logged at, unlogged since)
        self._log = get_logger("kvfabric.directory.kv_doctor").bind(instance=instance_id)

    async def run(self, poll_s: float = POLL_S) -> None:
        """`check_once` every `poll_s`, until cancelled. Whatever a check raises is logged and
        the next goes on (review, stop 71: only OSError, ValueError, nats errors and timeouts
        were caught, and a truncated `/healthz` reply, `http.client.IncompleteRead` /
        `BadStatusLine` / `LineTooLong`, or a JSON array body, AttributeError, ended the task
        silently: the lease bucket was never repaired again)."""
        while True:
            try:
                await self.check_once()
            except Exception as exc:
                self._check_failed(exc)
            else:
                self._failing = None
            await asyncio.sleep(poll_s)

    def _check_failed(self, exc: Exception) -> None:
        """Count it; log it when it fails another way than the last logged, or again after
        `CHECK_FAILED_LOG_S` (an unreachable monitor URL fails every 2 s for as long as it lasts)."""
        self.check_failures += 1
        error, now = type(exc).__name__, self.clock()
        if (
            self._failing is not None
            and self._failing[0] == error
            and now - self._failing[1] < CHECK_FAILED_LOG_S
        ):
            self._failing = (error, self._failing[1], self._failing[2] + 1)
            return
        unlogged = self._failing[2] if self._failing is not None and self._failing[0] == error else 0
        self._failing = (error, now, 0)
        self._log.warning("kv_doctor_check_failed", error=error, detail=repr(exc)[:200], unlogged=unlogged)

    async def check_once(self) -> list[str]:
        """Read `/healthz`; recreate every watched stream stuck long enough. Returns those done."""
        done = [stream for stream in list(self._pending) if await self._add_pending(stream)]
        errors = await self.fetch(self.monitor_url)
        now = self.clock()
        for stream, wait_s in self.waits_s.items():
            if stream not in errors:
                self.first_seen.pop(stream, None)
                continue
            first = self.first_seen.setdefault(stream, now)
            if first == now:
                self._log.error("kv_stream_write_error", stream=stream, error=errors[stream], wait_s=wait_s)
            if now - first >= wait_s and await self._repair(stream):
                done.append(stream)
                self.first_seen.pop(stream, None)
        return done

    async def _repair(self, stream: str) -> bool:
        js = self.nc.jetstream(timeout=API_TIMEOUT_S)
        info = await js.stream_info(stream)
        created_ns = int(info.created.timestamp() * 1e9) if info.created is not None else 0
        last = info.state.last_seq
        if not await self._disk_takes_writes(js):  # before any write of ours (the claim) too
            self._log.info("kv_stream_repair_waits", stream=stream, reason="the store takes no write yet")
            return False
        config = await js.key_value(self.config_bucket)
        claim = claim_key(stream, created_ns)
        try:
            await config.create(claim, f"{last + 1} {self.instance_id}".encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            entry = await config.get(claim)
            if (entry.value or b"").split()[1:] != [self.instance_id.encode()]:
                self.claims_lost += 1  # another instance claimed this stuck incarnation
                return False
        again = await js.stream_info(stream)
        again_ns = int(again.created.timestamp() * 1e9) if again.created is not None else 0
        if stream not in await self.fetch(self.monitor_url) or (again_ns, again.state.last_seq) != (
            created_ns,
            last,
        ):
            self._log.warning("kv_stream_repair_skipped", stream=stream, reason="healed or changed")
            return False
        self._log.warning("kv_stream_recreating", stream=stream, last_seq=last)
        try:
            await js.delete_stream(stream)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            self.failed += 1
            self._log.error("kv_stream_repair_failed", stream=stream, step="delete", error=type(exc).__name__)
            return False
        self._pending[stream] = dataclasses.replace(info.config, first_seq=last + 1)
        return await self._add_pending(stream)

    async def _add_pending(self, stream: str) -> bool:
        """Add a stream this instance deleted (again, until it takes)."""
        js = self.nc.jetstream(timeout=API_TIMEOUT_S)
        config = self._pending[stream]
        try:
            # Already there: added meanwhile by an instance that started, from the same floor.
            await add_or_find_stream(js, config)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            self.failed += 1
            self._log.error("kv_stream_repair_failed", stream=stream, step="add", error=type(exc).__name__)
            return False
        del self._pending[stream]
        self.recreated += 1
        self._log.warning("kv_stream_recreated", stream=stream, first_seq=config.first_seq)
        return True

    async def _disk_takes_writes(self, js: nats.js.JetStreamContext) -> bool:
        """A scratch file stream of this instance takes one message (then it is deleted)."""
        name = f"KVF_DIRECTORY_PROBE_{self.instance_id}".replace(".", "_").replace("-", "_")
        subject = f"kvf.v1.probe.{name}"
        try:
            await js.add_stream(StreamConfig(name=name, subjects=[subject], storage=StorageType.FILE))
            await js.publish(subject, b"\0" * PROBE_BYTES, timeout=HEALTHZ_TIMEOUT_S)
            return True
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return False
        finally:
            with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
                await js.delete_stream(name)

"""A local cluster for tests, benchmarks and tools: directory + segments as subprocesses on a
test NATS (bench/ and tools/ import it from here: nothing imports tests).

The directory is sharded: tests talk to it through a `DirectoryRouter` (`directory_call`,
`ask_directory`), which sends a keyed request to the leader of its keys' shard (a batch naming
keys of several shards is split and the replies merged back in request order), a listing to
every shard (merged), and a segment's `register` / `heartbeat` to every leading instance.
"""

from __future__ import annotations

import asyncio
import atexit
import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Final

import msgspec
import nats
from nats.aio.client import Client as NatsClient

from kvfabric.cluster.directory_router import DirectoryRouter
from kvfabric.cluster.requests import request
from kvfabric.ctl import queries
from kvfabric.format.clock import now_ms
from kvfabric.format.errors import KvfError, Unavailable
from kvfabric.format.ids import domain_in_id
from kvfabric.proto import directory as m
from kvfabric.proto import eviction as e
from kvfabric.proto.dataplane import ReadRef
from kvfabric.proto.segment import DrainRequest, SegmentState, segment_decoder
from kvfabric.proto.subjects import Service, endpoint_subject, segment_subject
from kvfabric.proto.tickets import read_token
from kvfabric.testing.nats_server import NatsServer
from kvfabric.testing.process import ServiceProcess

SECRET = "integration-cluster-secret-0123"
TIMEOUT_S = 10.0
LIST_PAGES_MAX: Final = 10_000


_run_shm_dir: Path | None = None
RUN_SHM_PREFIX: Final = "kvf-run-"


def run_shm_dir() -> Path:
    """This process's folder for the arenas, slot boards and id locks of the segments it starts
    (`KVF_SEGMENT_SHM_DIR`: /dev/shm/kvf-run-<pid>-<random>, made exclusively, 0700), removed when
    it exits. A segment id is a lock per folder, so another test run or benchmark on the same host
    with the same ids (`seg-a`) never collides with this one, nor does its cleanup unlink this
    one's files. Folders of processes that died without removing theirs (SIGKILL, a CI timeout)
    are removed by the next process that makes one."""
    global _run_shm_dir
    if _run_shm_dir is None:
        _remove_dead_runs_shm_dirs(Path("/dev/shm"))
        _run_shm_dir = Path(tempfile.mkdtemp(prefix=f"{RUN_SHM_PREFIX}{os.getpid()}-", dir="/dev/shm"))
        atexit.register(_remove_run_shm_dir, os.getpid(), _run_shm_dir)
    return _run_shm_dir


def _remove_run_shm_dir(owner_pid: int, path: Path) -> None:
    if os.getpid() == owner_pid:  # not in a forked child that exits normally: the folder is ours
        shutil.rmtree(path, ignore_errors=True)


def _remove_dead_runs_shm_dirs(parent: Path) -> list[Path]:
    """Remove the run folders under `parent` whose process is gone (a pid that was reused since
    keeps its folder: only a live process's is ever spared). Returns those removed."""
    removed = []
    for folder in parent.glob(f"{RUN_SHM_PREFIX}*-*"):
        pid = folder.name.removeprefix(RUN_SHM_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not folder.is_symlink() and folder.is_dir() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def service_env(**extra: str) -> dict[str, str]:
    # Debug logs: tests read every request's `request_handled` line (default: errors and slow only).
    env = dict(os.environ, KVF_CLUSTER_SECRET=SECRET, **extra)
    env.setdefault("KVF_LOG_LEVEL", "debug")
    if "KVF_SEGMENT_SHM_DIR" not in env:
        env["KVF_SEGMENT_SHM_DIR"] = str(run_shm_dir())
    return env


@contextmanager
def service_process(nats: NatsServer, module: str, ready_event: str, **env: str) -> Iterator[ServiceProcess]:
    """`python -m <module>` on the test's NATS with JSON logs, ready once it logs `ready_event`;
    stopped (SIGTERM, then SIGKILL) afterwards."""
    proc = ServiceProcess.python_module(
        module, "--nats-url", nats.url, "--metrics-port", "0", "--log-json", env=service_env(**env)
    )
    proc.start()
    try:
        proc.wait_for_event(ready_event, 20.0)
        yield proc
    finally:
        proc.stop(timeout_s=10.0)


def directory_process(
    nats: NatsServer, ready_event: str = "directory_started", **env: str
) -> AbstractContextManager[ServiceProcess]:
    """A directory instance; `ready_event="directory_standby"` for one that will wait as a standby."""
    return service_process(nats, "kvfabric.directory", ready_event, **env)


@contextmanager
def segment_process(
    nats: NatsServer, segment_id: str, arena_bytes: int = 256 << 20, **env: str
) -> Iterator[ServiceProcess]:
    try:
        with service_process(
            nats,
            "kvfabric.segment_storage",
            "segment_started",
            KVF_SEGMENT_ID=segment_id,
            KVF_SEGMENT_BYTES=str(arena_bytes),
            **env,
        ) as proc:
            yield proc
    finally:
        shm_dir = env.get("KVF_SEGMENT_SHM_DIR") or os.environ.get("KVF_SEGMENT_SHM_DIR") or run_shm_dir()
        for leftover in glob.glob(f"{glob.escape(str(shm_dir))}/kvf-{segment_id}[-.]*"):  # after a SIGKILL
            os.unlink(leftover)


def eviction_process(nats: NatsServer, **env: str) -> AbstractContextManager[ServiceProcess]:
    return service_process(nats, "kvfabric.eviction_policy", "eviction_started", **env)


def repair_process(nats: NatsServer, **env: str) -> AbstractContextManager[ServiceProcess]:
    return service_process(nats, "kvfabric.repair", "repair_started", **env)


def prefetch_process(nats: NatsServer, **env: str) -> AbstractContextManager[ServiceProcess]:
    return service_process(nats, "kvfabric.prefetch", "prefetch_started", **env)


def signed_ref(
    segment_id: str, incarnation: int, slot: int, generation: int, size: int, ttl_ms: int = 60_000
) -> ReadRef:
    """A read reference with a read token signed like the directory signs them (tests know the
    cluster secret): for data-plane tests that build references themselves."""
    expires = now_ms() + ttl_ms
    token = read_token(SECRET.encode(), segment_id, incarnation, slot, generation, size, expires)
    return ReadRef(incarnation, slot, generation, size, token, expires)


TEST_GATHER_S: Final = 1.0


async def directory_router(nc: NatsClient, tenant: str = "") -> DirectoryRouter:
    """A router on `nc` (a tenant's: its tenant subjects) with the shard map loaded. Tests wait
    up to `TEST_GATHER_S` for the map (a refresh ends as soon as every shard is covered): on a
    loaded machine the default 0.25 s missed a directory busy with a vLLM engine beside it."""
    router = DirectoryRouter(nc, tenant=tenant, gather_s=TEST_GATHER_S)
    await router.known_shards()
    return router


# verb -> the field listing a batch request's items, and an item's key
_BATCHES: Final[dict[str, tuple[str, Callable[[Any], bytes]]]] = {
    "put_begin": ("objects", lambda o: o.key),
    "confirm": ("confirms", lambda c: c.key),
    "put_commit": ("keys", lambda k: k),
    "put_abort": ("keys", lambda k: k),
    "evict": ("groups", lambda g: g),
    "freed": ("freed", lambda f: f.key),
    "lookup": ("groups", lambda g: g),
    "pin": ("groups", lambda g: g),
}


def _shard_of(router: DirectoryRouter, raw: bytes) -> int:
    try:
        return router.shard_of(raw)
    except ValueError:
        return 0  # malformed: any leader answers bad_request


def _shard_of_message(router: DirectoryRouter, verb: str, message: msgspec.Struct) -> int | None:
    """The one shard a request is for; None for a batch naming keys of several shards."""
    explicit = getattr(message, "shard", None)
    if explicit is not None:
        return int(explicit)
    if verb in _BATCHES:
        field, key_of = _BATCHES[verb]
        shards = {_shard_of(router, key_of(item)) for item in getattr(message, field)}
        return None if len(shards) > 1 else min(shards, default=0)  # no key: shard 0
    raw = getattr(message, "key", None) or getattr(message, "group", None)
    return _shard_of(router, raw) if raw else 0


async def _split(
    router: DirectoryRouter, verb: str, message: msgspec.Struct, timeout_s: float
) -> msgspec.Struct:
    """A batch naming keys of several shards: one request per shard, replies merged back in
    request order. A lookup or pin that several shards would lease is refused (a test wanting
    that uses the client, which holds one lease per shard)."""
    field, key_of = _BATCHES[verb]
    items = getattr(message, field)
    positions: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        positions.setdefault(_shard_of(router, key_of(item)), []).append(i)

    async def one(shard: int, indexes: list[int]) -> Any:
        part = msgspec.structs.replace(message, **{field: [items[i] for i in indexes]})
        return await router.ask(shard, verb, part, timeout_s)

    replies = await asyncio.gather(*(one(s, ix) for s, ix in positions.items()))
    first: msgspec.Struct = msgspec.structs.replace(replies[0], epoch=max(r.epoch for r in replies))
    if isinstance(first, m.PutBeginReply | m.ConfirmReply | m.PutCommitReply | m.EvictReply):
        results: list[Any] = [None] * len(items)
        for indexes, reply in zip(positions.values(), replies, strict=True):
            for i, result in zip(indexes, reply.results, strict=True):
                results[i] = result
        return msgspec.structs.replace(first, results=results)
    if isinstance(first, m.PutAbortReply):
        return msgspec.structs.replace(first, aborted=sum(r.aborted for r in replies))
    if isinstance(first, m.FreedAck):
        return msgspec.structs.replace(first, accepted=sum(r.accepted for r in replies))
    granted = [r for r in replies if getattr(r, "lease_id", 0) or getattr(r, "pin_id", 0)]
    assert not granted, (
        f"a {verb} across shards {sorted(positions)} was granted leases: use one shard's groups"
    )
    return first  # a miss (nothing pinned) in every shard


async def ask_directory(
    router: DirectoryRouter, verb: str, message: msgspec.Struct, timeout_s: float = TIMEOUT_S
) -> msgspec.Struct:
    """One directory request through `router`: listings merged over every shard (`list_groups`
    returns every page at once), `register` / `heartbeat` to every leading instance (the first
    error raised), a keyed request to its shard's leader (split when it spans shards)."""
    reply: Any
    if verb == "list_segments":
        reply = await queries.list_segments(router, timeout_s)
    elif verb == "list_groups":
        assert isinstance(message, m.ListGroups)
        groups = await router.list_groups(message, timeout_s, LIST_PAGES_MAX)
        # group-key order (domain digest, then chain hash), as one core pages
        groups.sort(key=lambda g: (domain_in_id(g.namespace), g.group))
        reply = m.GroupList(epoch=queries.newest_epoch(router), groups=groups)
    elif verb == "list_leases":
        assert isinstance(message, m.ListLeases)
        leases = await queries.list_leases(router, message.limit, timeout_s, pins_only=message.pins_only)
        reply = m.LeaseList(epoch=queries.newest_epoch(router), leases=[x.lease for x in leases])
    elif verb == "list_tenants":
        assert isinstance(message, m.ListTenants)
        reply = await queries.list_tenants(router, message.limit, timeout_s)
    elif verb in ("register", "heartbeat"):
        answers = await router.ask_all(verb, message, timeout_s)
        errors = [a for a in answers if isinstance(a, KvfError)]
        if errors or not answers:
            raise errors[0] if errors else Unavailable("no directory instance leads a shard")
        reply = answers[0]
    else:
        shard = _shard_of_message(router, verb, message)
        if shard is None:
            reply = await _split(router, verb, message, timeout_s)
        else:
            reply = await router.ask(shard, verb, message, timeout_s)
    assert isinstance(reply, msgspec.Struct)
    return reply


async def directory_call(nc: NatsClient, verb: str, message: msgspec.Struct) -> msgspec.Struct:
    """`ask_directory` on a router of its own (the shard map asked afresh)."""
    return await ask_directory(await directory_router(nc), verb, message)


async def eviction_status(nats_url: str) -> e.EvictionStatus:
    """The eviction policy's `status` (on a connection of its own)."""
    nc = await nats.connect(nats_url)
    try:
        reply = await request(
            nc,
            endpoint_subject(Service.EVICTION, "status"),
            e.EvictionStatusRequest(),
            e.eviction_decoder,
            5.0,
        )
        assert isinstance(reply, e.EvictionStatus)
        return reply
    finally:
        await nc.close()


async def next_admission_filter(nats_url: str, timeout_s: float = 10.0) -> e.AdmissionFilter:
    """The next admission filter the eviction policy publishes."""
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(endpoint_subject(Service.EVICTION, e.ADMISSION_FILTER_VERB))
        decoded = e.eviction_decoder.decode((await sub.next_msg(timeout=timeout_s)).data)
        assert isinstance(decoded, e.AdmissionFilter)
        return decoded
    finally:
        await nc.close()


async def segment_state(nc: NatsClient, segment_id: str, draining: bool = False) -> SegmentState:
    reply = await request(
        nc, segment_subject(segment_id, "drain"), DrainRequest(draining=draining), segment_decoder, TIMEOUT_S
    )
    assert isinstance(reply, SegmentState)
    return reply

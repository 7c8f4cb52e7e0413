"""Run a directory instance: `python -m kvfabric.directory --nats-url ... [runtime flags]`.

Directory-specific settings come from the environment (see `kvfabric.directory.settings`);
`KVF_CLUSTER_SECRET` is required. Any number of instances may run. Keys belong to
`KVF_DIRECTORY_SHARDS` virtual shards; every shard has a leader lease in JetStream KV
(`kvfabric.directory.leader`): an instance leads the shards whose lease it holds, each under its
own epoch, and serves them on its own subjects (`kvfabric.directory.shard_host`); the others are led
elsewhere or wait for a lapse. A new shard leader rebuilds that shard's index from the
segments' reports under its epoch (`DirectoryCore.adopt`), serves, and frees nothing for a grace
period as long as the longest read lease. An instance whose lease lapses stops serving at once
and exits with 75 (EX_TEMPFAIL): its supervisor restarts it (it rejoins as a standby). What an
instance does about the shards it leads (start, retry, give up, hand over, stop) is decided by
`kvfabric.core.shard_lifecycle.ShardLifecycle` and performed by
`kvfabric.directory.shard_lifecycle.ShardLifecycleShell`, which builds the host; this module
only wires the pieces and runs the bounded stop.

The stop is bounded (docs/design.md: liveness is an invariant): the election loop and shard starts
are cancelled and awaited for `TASKS_STOP_TIMEOUT_S`, the shards' tasks for
`kvfabric.directory.shard_host.STOP_TIMEOUT_S`; a task still running then (a cancellation swallowed
for good) makes the process exit at once with 79 (`directory_stop_overran`, naming the tasks),
and the runtime's watchdog ends it `stop_deadline_ms` after the stop was asked whatever else
hangs (`kvfabric.runtime.deadline`). A lapsed lease thus always ends in an exit within a bound,
never in a live process that leads nothing. Once every shard stopped serving, what this
instance holds in KV is handed back (`LeaderElection.release_held`, within `RELEASE_TIMEOUT_S`:
its lease keys, any other lease key left with its id, its member key) so that standbys take
over without waiting the lease TTL (15 s on a NATS cluster), nor rebalancing instances the
members TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Final

import nats

from kvfabric.cluster.natsauth import nats_auth_from_env, nats_servers
from kvfabric.core.leadership import LeadershipConfig
from kvfabric.core.shard_lifecycle import LifecycleConfig
from kvfabric.directory import cpu_priority
from kvfabric.directory.admission_filter import AdmissionFilterCollector, AdmissionFilterFeed
from kvfabric.directory.fair import FairGate
from kvfabric.directory.kv_buckets import CONFIG_BUCKET, LEADERS_BUCKET, MEMBERS_BUCKET, agree_on_shards
from kvfabric.directory.kv_doctor import TTL_MARGIN_S, KvDoctor
from kvfabric.directory.leader import LeaderElection
from kvfabric.directory.metrics import DirectoryCollector
from kvfabric.directory.segment_registry import SegmentRegistry
from kvfabric.directory.settings import DirectorySettings, load_directory_settings
from kvfabric.directory.shard_host import ShardHost
from kvfabric.directory.shard_lifecycle import ShardLifecycleShell, ShellFactory
from kvfabric.proto.subjects import Service
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings, SettingsError
from kvfabric.runtime.deadline import EXIT_STOP_OVERRUN, cancel_and_wait, exit_now
from kvfabric.runtime.gcpolicy import freeze_long_lived
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import EXIT_UNAVAILABLE, ServiceRuntime

DIRECTORY_VERSION: Final = "0.2.0"
EXIT_USAGE: Final = 2
EXIT_LEADERSHIP_LOST: Final = 75
SHARD_START_ATTEMPTS: Final = 3  # a shard's start tried this often before the instance stops
RENEW_EVERY_MS_MAX: Final = 1_000  # leader lease renewals at least this often
HANDOVER_DRAIN_MS: Final = 1_000  # a handed-over shard's queued events still go out this long
SHARD_START_RETRY_MS: Final = 500  # the n-th failed start is tried again n x this later
TASKS_STOP_TIMEOUT_S: Final = 2.0  # the election loop and shard starts, once cancelled
NATS_CLOSE_TIMEOUT_S: Final = 2.0
RELEASE_TIMEOUT_S: Final = 1.0  # handing back the lease keys and the member key, at an orderly stop


def leadership_config(config: DirectorySettings) -> LeadershipConfig:
    """Renewals every second (every third of a shorter lease), retried a quarter of that after
    one goes unanswered; an instance stops acting a sixth of the lease before it could lapse."""
    ttl = config.leader_lease_ttl_ms
    renew_every_ms = max(1, min(ttl // 3, RENEW_EVERY_MS_MAX))
    return LeadershipConfig(
        shards=config.shards,
        lease_ttl_ms=ttl,
        renew_every_ms=renew_every_ms,
        safety_margin_ms=max(1, ttl // 6),
        members_ttl_ms=ttl,
        renew_retry_ms=max(1, renew_every_ms // 4),
    )


async def serve(settings: RuntimeSettings) -> int:
    log = get_logger("kvfabric.directory").bind(instance_id=settings.instance_id)
    try:
        config = load_directory_settings(os.environ)
    except SettingsError as exc:
        log.error("settings_invalid", error=str(exc))
        return EXIT_USAGE
    # Its CPU under a flood (issue 21 row 2), before any thread starts; kept where not permitted.
    priority = cpu_priority.apply(config.cpu_priority)
    log.info("directory_cpu_priority", **dataclasses.asdict(priority))
    runtime = ServiceRuntime(
        Service.DIRECTORY,
        settings,
        version=DIRECTORY_VERSION,
        description="kvfabric directory: object lifecycle, publish, leases, placement",
        tenant_refusal_hold_ms=config.tenant_refusal_hold_ms,
        tarpit=config.tarpit,
    )
    runtime.stop_on_signals()
    try:
        # Reconnects without end once connected (its leases and the KV), but the first connect
        # is bounded as the runtime's is (its attempts × their wait, + a connect timeout): with
        # NATS unreachable or the credentials refused it retried forever, alive and serving
        # nothing, logging every retry, so no supervisor restarted it (review, 2026-12-05).
        first_connect_s = (
            settings.nats_reconnect_attempts_max * settings.nats_reconnect_wait_ms
            + settings.nats_connect_timeout_ms
        ) / 1000
        nc = await asyncio.wait_for(
            nats.connect(
                nats_servers(settings.nats_url),
                **nats_auth_from_env(os.environ).connect_options(),
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.2,
                error_cb=_nats_error(log),
            ),
            first_connect_s,
        )
        election = LeaderElection(
            nc,
            settings.instance_id,
            leadership_config(config),
            rebalance=config.rebalance,
            replicas=config.kv_replicas,
        )
        await election.open()
        registry = await SegmentRegistry.open(nc, config.kv_replicas)
        cluster_shards = await agree_on_shards(nc, config.shards, config.kv_replicas)
    except Exception as exc:
        log.error("directory_start_failed", error=repr(exc))
        return EXIT_UNAVAILABLE
    if cluster_shards != config.shards:
        log.error("shard_count_mismatch", configured=config.shards, cluster=cluster_shards)
        await nc.close()
        return EXIT_USAGE
    make_shell = ShellFactory(nc, config)
    lifecycle = ShardLifecycleShell(
        election,
        runtime,
        lambda may_act, restart_shard: ShardHost(
            settings.instance_id,
            config.shards,
            config.core,
            registry=registry,
            make_shell=make_shell,
            may_act=may_act,
            restart_shard=restart_shard,
            grants=config.grants,
            lookup_reply_min_ms=config.lookup_reply_min_ms,
            # tenants take turns (kvfabric.directory.fair); own refusals counted by the tarpit
            fair=FairGate(config.fair, tarpit=runtime),
        ),
        LifecycleConfig(
            start_attempts_max=SHARD_START_ATTEMPTS,
            start_retry_ms=SHARD_START_RETRY_MS,
            handover_drain_ms=HANDOVER_DRAIN_MS,
        ),
    )
    host = lifecycle.host
    host.attach(runtime)
    runtime.metrics.registry.register(DirectoryCollector(host, election.core))
    admission = AdmissionFilterFeed(host)  # the eviction policy's filter, applied at put_begin
    runtime.metrics.registry.register(AdmissionFilterCollector(admission))
    try:
        await runtime.start()
        await host.serve_shard_map(runtime.nc)
        await admission.subscribe(runtime.nc)
        host.metrics_port = runtime.metrics_port
    except Exception as exc:
        log.error("directory_start_failed", error=repr(exc))
        runtime.request_stop("start_failed")  # arms the stop deadline: a cleanup that hangs exits
        await runtime.stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(nc.close(), NATS_CLOSE_TIMEOUT_S)
        return EXIT_UNAVAILABLE
    election_task = lifecycle.run_election()
    doctor_task: asyncio.Task[None] | None = None
    if config.nats_monitor_url:  # recreate a lease bucket nats-server says is stuck (kv_doctor)
        wait_s = config.leader_lease_ttl_ms / 1000 + TTL_MARGIN_S
        doctor = KvDoctor(
            nc,
            config.nats_monitor_url,
            settings.instance_id,
            {f"KV_{LEADERS_BUCKET}": wait_s, f"KV_{MEMBERS_BUCKET}": wait_s},
            config_bucket=CONFIG_BUCKET,
        )
        doctor_task = asyncio.create_task(doctor.run(), name="directory-kv-doctor")
        # like the service's other tasks: one that ends with an exception stops the instance
        # (its supervisor restarts it) instead of the lease bucket never being repaired again
        # (review, stop 71; `KvDoctor.run` itself catches what a check raises)
        runtime.watch(doctor_task, doctor_task.get_name())

    log.info("directory_standby", metrics_port=runtime.metrics_port, shards=config.shards)
    freeze_long_lived("directory_standby")  # and again once led shards are rebuilt (ShardHost)
    reason = await runtime.wait_stop_requested()
    tasks = [election_task, *lifecycle.start_tasks(), *([doctor_task] if doctor_task else [])]
    stuck = [t.get_name() for t in await cancel_and_wait(tasks, TASKS_STOP_TIMEOUT_S)]
    stuck += await host.stop()
    if not stuck:  # nothing serves any more: hand the leases and the member key back (no TTL waited)
        released = await election.release_held(RELEASE_TIMEOUT_S)
        log.info("leader_leases_released", shards=released, reason=reason)
    if stuck:  # alive but leading nothing is the one outcome not allowed: exit, be restarted
        exit_now(
            EXIT_STOP_OVERRUN,
            "directory_stop_overran",
            identity={"service": Service.DIRECTORY.value, "instance_id": settings.instance_id},
            reason=reason,
            tasks=stuck,
        )
    code = await runtime.stop()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(nc.close(), NATS_CLOSE_TIMEOUT_S)
    return EXIT_LEADERSHIP_LOST if lifecycle.lost else code


def _nats_error(log: Any) -> Callable[[Exception], Awaitable[None]]:
    """nats-py's error callback: one warning line per error (its default logged a traceback
    on every retry)."""

    async def logged(exc: Exception) -> None:
        log.warning("nats_error_reported", error=repr(exc))

    return logged


app = service_cli(name="directory", help="kvfabric directory service (kvf.v1.directory.*).", main=serve)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.directory"))

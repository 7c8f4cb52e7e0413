"""Run a directory instance: `python -m kvfabric.directory --nats-url ... [runtime flags]`.

Directory-specific settings come from the environment (see `kvfabric.directory.settings`);
`KVF_CLUSTER_SECRET` is required. Any number of instances may run. Keys belong to
`KVF_DIRECTORY_SHARDS` virtual shards; every shard has a leader lease in JetStream KV
(`kvfabric.directory.leader`): an instance leads the shards whose lease it holds, each under its
own epoch, and serves them on its own subjects (`kvfabric.directory.host`); the others are led
elsewhere or wait for a lapse. A new shard leader rebuilds that shard's index from the
segments' reports under its epoch (`DirectoryCore.adopt`), serves, and frees nothing for a grace
period as long as the longest read lease. An instance whose lease lapses stops serving at once
and exits with 75 (EX_TEMPFAIL): its supervisor restarts it (it rejoins as a standby).

The stop is bounded (docs/design.md: liveness is an invariant): the election loop and shard starts
are cancelled and awaited for `TASKS_STOP_TIMEOUT_S`, the shards' tasks for
`kvfabric.directory.host.STOP_TIMEOUT_S`; a task still running then (a cancellation swallowed
for good) makes the process exit at once with 79 (`directory_stop_overran`, naming the tasks),
and the runtime's watchdog ends it `stop_deadline_ms` after the stop was asked whatever else
hangs (`kvfabric.runtime.deadline`). A lapsed lease thus always ends in an exit within a bound,
never in a live process that leads nothing. Once every shard stopped serving, the lease keys
still held are deleted (`LeaderElection.release_held`, within `RELEASE_TIMEOUT_S`) so that
standbys take over without waiting the lease TTL (15 s on a NATS cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from typing import Final

import nats

from kvfabric.core.directory import DirectoryCore
from kvfabric.core.leadership import REASON_HANDOVER, REASON_LEAVING, LeadershipConfig
from kvfabric.directory.events import EventsStream
from kvfabric.directory.fair import FairGate
from kvfabric.directory.handlers import DirectoryShell
from kvfabric.directory.host import ShardHost
from kvfabric.directory.kv_buckets import CONFIG_BUCKET, LEADERS_BUCKET, MEMBERS_BUCKET, agree_on_shards
from kvfabric.directory.kv_doctor import TTL_MARGIN_S, KvDoctor
from kvfabric.directory.leader import LeaderElection
from kvfabric.directory.metrics import DirectoryCollector
from kvfabric.directory.segment_registry import SegmentRegistry
from kvfabric.directory.settings import DirectorySettings, load_directory_settings
from kvfabric.format.clock import monotonic_ms
from kvfabric.proto.subjects import Service
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings, SettingsError
from kvfabric.runtime.deadline import EXIT_STOP_OVERRUN, cancel_and_wait, exit_now
from kvfabric.runtime.gcpolicy import freeze_long_lived
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.natsauth import nats_auth_from_env
from kvfabric.runtime.service import EXIT_UNAVAILABLE, ServiceRuntime

DIRECTORY_VERSION: Final = "0.2.0"
EXIT_USAGE: Final = 2
EXIT_LEADERSHIP_LOST: Final = 75
SHARD_START_ATTEMPTS: Final = 3
RENEW_EVERY_MS_MAX: Final = 1_000  # leader lease renewals at least this often
HANDOVER_DRAIN_S: Final = 1.0
SHARD_START_RETRY_S: Final = 0.5
TASKS_STOP_TIMEOUT_S: Final = 2.0  # the election loop and shard starts, once cancelled
NATS_CLOSE_TIMEOUT_S: Final = 2.0
RELEASE_TIMEOUT_S: Final = 1.0  # deleting the lease keys still held, at an orderly stop


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
    runtime = ServiceRuntime(
        Service.DIRECTORY,
        settings,
        version=DIRECTORY_VERSION,
        description="kvfabric directory: object lifecycle, publish, leases, placement",
    )
    runtime.stop_on_signals()
    try:
        nc = await nats.connect(
            settings.nats_url,
            **nats_auth_from_env(os.environ).connect_options(),
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
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
    lost = False
    starting: set[asyncio.Task[None]] = set()

    events_stream: EventsStream | None = None  # one per instance: its shells share its repairs

    def make_shell(core: DirectoryCore) -> DirectoryShell:
        nonlocal events_stream
        shell = DirectoryShell(
            core,
            tick_ms=config.tick_ms,
            events_outbox_max=config.events_outbox_max,
            events_max_age_s=config.events_max_age_s,
            free_timeout_s=config.free_timeout_s,
            events_replicas=config.kv_replicas,
            events_stream=events_stream,
        )
        if events_stream is None:
            events_stream = EventsStream(
                nc, shell.events_config(), stuck_after_failures=config.events_stuck_after_failures
            )
            shell.events_stream = events_stream
        return shell

    host = ShardHost(
        settings.instance_id, config.shards, config.core, registry=registry, make_shell=make_shell
    )
    host.grants = config.grants
    host.lookup_reply_min_ms = config.lookup_reply_min_ms
    host.fair = FairGate(config.fair)  # tenants take turns (kvfabric.directory.fair)
    host.may_act = lambda shard, epoch: (
        not lost and election.core.epoch(shard, now_ms=monotonic_ms()) == epoch
    )
    host.attach(runtime)
    runtime.metrics.registry.register(DirectoryCollector(host, election.core))

    async def start_or_give_up(shard: int, epoch: int) -> None:
        """Rebuild and serve the shard under the epoch this instance leads it with now; a shard
        led but not served would be lost to callers while this instance renews its lease, so
        after the attempts the instance stops."""
        nonlocal lost
        for attempt in range(1, SHARD_START_ATTEMPTS + 1):
            current = election.core.epoch(shard, now_ms=monotonic_ms())
            if current is None or lost:
                return  # not ours any more: whoever leads it now serves it
            try:
                await host.start_shard(shard, current)
                return
            except Exception as exc:
                log.warning(
                    "shard_start_failed", shard=shard, epoch=current, attempt=attempt, error=repr(exc)
                )
                await asyncio.sleep(SHARD_START_RETRY_S * attempt)
        lost = True
        runtime.request_stop("shard_start_failed")

    host.restart_shard = start_or_give_up  # after a rebuild for a missing segment

    async def on_start(shard: int, epoch: int) -> None:
        # The rebuild runs beside the election loop: renewals of other shards must not wait.
        task = asyncio.create_task(start_or_give_up(shard, epoch), name=f"directory-start-{shard}")
        starting.add(task)
        task.add_done_callback(starting.discard)

    async def on_stop(shard: int, epoch: int, reason: str) -> None:
        nonlocal lost
        if reason in (REASON_HANDOVER, REASON_LEAVING):
            # Stops serving before the lease key is released; queued events drain meanwhile.
            await host.stop_shard(shard, drain_s=HANDOVER_DRAIN_S)
            return
        lost = True  # a lapsed or unrenewable lease: stop everything, the supervisor restarts us
        runtime.request_stop(f"leadership_lost:{reason}")

    election_task: asyncio.Task[None] | None = None
    try:
        await runtime.start()
        await host.serve_shard_map(runtime.nc)
        host.metrics_port = runtime.metrics_port
    except Exception as exc:
        log.error("directory_start_failed", error=repr(exc))
        await runtime.stop()
        await nc.close()
        return EXIT_UNAVAILABLE
    election_task = asyncio.create_task(election.run(on_start, on_stop), name="directory-election")
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

    def election_ended(task: asyncio.Task[None]) -> None:
        # The loop runs forever: if it ends, nothing renews the leases; stop serving at once.
        nonlocal lost
        if task.cancelled():
            return
        lost = True
        log.error("election_loop_failed", error=repr(task.exception()))
        runtime.request_stop("election_loop_failed")

    election_task.add_done_callback(election_ended)
    log.info("directory_standby", metrics_port=runtime.metrics_port, shards=config.shards)
    freeze_long_lived("directory_standby")  # and again once led shards are rebuilt (ShardHost)
    reason = await runtime.wait_stop_requested()
    tasks = [election_task, *starting, *([doctor_task] if doctor_task else [])]
    stuck = [t.get_name() for t in await cancel_and_wait(tasks, TASKS_STOP_TIMEOUT_S)]
    stuck += await host.stop()
    if not stuck:  # nothing serves any more: hand the leases back (standbys need not wait the TTL)
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
    return EXIT_LEADERSHIP_LOST if lost else code


app = service_cli(name="directory", help="kvfabric directory service (kvf.v1.directory.*).", main=serve)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.directory"))

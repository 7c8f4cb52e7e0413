"""Run a directory instance: `python -m kvfabric.directory --nats-url ... [runtime flags]`.

Directory-specific settings come from the environment (see `kvfabric.directory.settings`);
`KVF_CLUSTER_SECRET` is required. Any number of instances may run: one leads (it holds the
leader lease of the shard in JetStream KV, see `kvfabric.directory.leader`), the others wait as
standbys. A new leader rebuilds the index from the segments' reports under a new epoch
(`kvfabric.directory.rebuild`, `DirectoryCore.adopt`), serves, and frees nothing for a grace
period as long as the longest read lease. A leader whose lease lapses stops serving at once and
exits with 75 (EX_TEMPFAIL): its supervisor restarts it as a standby.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Final

import nats

from kvfabric.core.directory import DirectoryCore
from kvfabric.core.leadership import LeadershipConfig
from kvfabric.directory.handlers import DirectoryShell, now_ms
from kvfabric.directory.leader import LeaderElection, SegmentRegistry, monotonic_ms
from kvfabric.directory.metrics import DirectoryCollector
from kvfabric.directory.rebuild import gather_holdings
from kvfabric.directory.settings import DirectorySettings, load_directory_settings
from kvfabric.proto.subjects import Service
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings, SettingsError
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.natsauth import nats_auth_from_env
from kvfabric.runtime.service import EXIT_UNAVAILABLE, ServiceRuntime

DIRECTORY_VERSION: Final = "0.2.0"
EXIT_USAGE: Final = 2
EXIT_LEADERSHIP_LOST: Final = 75
SHARD: Final = 0  # one shard for now: sharding over instances comes next (docs/directory-ha.md)


def leadership_config(config: DirectorySettings) -> LeadershipConfig:
    ttl = config.leader_lease_ttl_ms
    return LeadershipConfig(
        shards=1,
        lease_ttl_ms=ttl,
        renew_every_ms=max(1, ttl // 3),
        safety_margin_ms=max(1, ttl // 6),
        members_ttl_ms=ttl,
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
        election = LeaderElection(nc, settings.instance_id, leadership_config(config))
        await election.open()
        registry = await SegmentRegistry.open(nc)
    except Exception as exc:
        log.error("directory_start_failed", error=repr(exc))
        return EXIT_UNAVAILABLE
    won: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    lost = False

    async def on_start(shard: int, epoch: int) -> None:
        if not won.done():
            won.set_result(epoch)

    async def on_stop(shard: int, epoch: int, reason: str) -> None:
        nonlocal lost
        lost = True
        runtime.request_stop(f"leadership_lost:{reason}")

    election_task = asyncio.create_task(election.run(on_start, on_stop))
    log.info("directory_standby")
    stop_requested = asyncio.create_task(runtime.wait_stop_requested())
    waits: list[asyncio.Future[object]] = [won, stop_requested]  # type: ignore[list-item]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if not won.done():  # stopped while a standby
        election_task.cancel()
        await nc.close()
        return 0
    epoch = won.result()
    started_ms = monotonic_ms()
    holdings = await gather_holdings(nc, await registry.all(), epoch)
    core = DirectoryCore(config.core, epoch=epoch)
    adopt_effects = core.adopt(holdings, now_ms())
    shell = DirectoryShell(
        core,
        tick_ms=config.tick_ms,
        events_outbox_max=config.events_outbox_max,
        events_max_age_s=config.events_max_age_s,
        free_timeout_s=config.free_timeout_s,
    )
    shell.registry = registry
    shell.grants = config.grants
    shell.lookup_reply_min_ms = config.lookup_reply_min_ms
    shell.may_act = lambda: not lost and election.core.epoch(SHARD, now_ms=monotonic_ms()) == epoch
    shell.attach(runtime)
    runtime.metrics.registry.register(DirectoryCollector(shell))
    try:
        await runtime.start()
        await shell.start(runtime.nc)
        await shell.perform(adopt_effects)
    except Exception as exc:
        log.error("directory_start_failed", error=repr(exc))
        election_task.cancel()
        await runtime.stop()
        await nc.close()
        return EXIT_UNAVAILABLE
    log.info(
        "directory_started",
        metrics_port=runtime.metrics_port,
        epoch=epoch,
        segments=len(holdings),
        groups_adopted=len(core.published),
        rebuild_ms=monotonic_ms() - started_ms,
        grace_until_ms=core.grace_until_ms,
    )
    await stop_requested
    await shell.stop()
    code = await runtime.stop()
    election_task.cancel()
    await asyncio.gather(election_task, return_exceptions=True)
    await nc.close()
    return EXIT_LEADERSHIP_LOST if lost else code


app = service_cli(name="directory", help="kvfabric directory service (kvf.v1.directory.*).", main=serve)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.directory"))

"""Run a directory instance: `python -m kvfabric.directory --nats-url ... [runtime flags]`.

Directory-specific settings come from the environment (see `kvfabric.directory.settings`);
`KVF_CLUSTER_SECRET` is required. One instance holds one directory shard (epoch 1); leader
election and sharding over JetStream KV come with the HA work.
"""

from __future__ import annotations

import os
import sys
from typing import Final

from kvfabric.core.directory import DirectoryCore
from kvfabric.directory.handlers import DirectoryShell
from kvfabric.directory.metrics import DirectoryCollector
from kvfabric.directory.settings import load_directory_settings
from kvfabric.proto.subjects import Service
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings, SettingsError
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import EXIT_UNAVAILABLE, ServiceRuntime

DIRECTORY_VERSION: Final = "0.1.0"
EXIT_USAGE: Final = 2


async def serve(settings: RuntimeSettings) -> int:
    log = get_logger("kvfabric.directory")
    try:
        config = load_directory_settings(os.environ)
    except SettingsError as exc:
        log.error("settings_invalid", error=str(exc))
        return EXIT_USAGE
    shell = DirectoryShell(
        DirectoryCore(config.core),
        tick_ms=config.tick_ms,
        events_outbox_max=config.events_outbox_max,
        events_max_age_s=config.events_max_age_s,
        free_timeout_s=config.free_timeout_s,
    )
    runtime = ServiceRuntime(
        Service.DIRECTORY,
        settings,
        version=DIRECTORY_VERSION,
        description="kvfabric directory: object lifecycle, publish, leases, placement",
    )
    shell.attach(runtime)
    runtime.metrics.registry.register(DirectoryCollector(shell))
    runtime.stop_on_signals()
    try:
        await runtime.start()
        await shell.start(runtime.nc)
    except Exception as exc:
        log.error("directory_start_failed", error=repr(exc))
        await runtime.stop()
        return EXIT_UNAVAILABLE
    log.info("directory_started", metrics_port=runtime.metrics_port, epoch=shell.core.epoch)
    await runtime.wait_stop_requested()
    await shell.stop()
    return await runtime.stop()


app = service_cli(name="directory", help="kvfabric directory service (kvf.v1.directory.*).", main=serve)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.directory"))

"""Run the repair service: `python -m kvfabric.repair --nats-url ... [runtime flags]`.

Settings come from the environment (see `kvfabric.repair.settings`). One instance per cluster:
it restores every object's replica target across failure domains, under a bandwidth budget.
"""

from __future__ import annotations

import os
import sys
from typing import Final

from kvfabric.core.repair import RepairCore
from kvfabric.proto.subjects import Service
from kvfabric.repair.metrics import RepairCollector
from kvfabric.repair.settings import load_repair_settings
from kvfabric.repair.shell import RepairShell, now_ms
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings, SettingsError
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import EXIT_UNAVAILABLE, ServiceRuntime

REPAIR_VERSION: Final = "0.1.0"
EXIT_USAGE: Final = 2


async def serve(settings: RuntimeSettings) -> int:
    log = get_logger("kvfabric.repair")
    try:
        config = load_repair_settings(os.environ)
    except SettingsError as exc:
        log.error("settings_invalid", error=str(exc))
        return EXIT_USAGE
    shell = RepairShell(
        RepairCore(config.core, now_ms=now_ms()),
        replicas_target=config.replicas_target,
        scan_ms=config.scan_ms,
        tick_ms=config.tick_ms,
        request_timeout_s=config.request_timeout_s,
        copy_timeout_s=config.copy_timeout_s,
    )
    runtime = ServiceRuntime(
        Service.REPAIR,
        settings,
        version=REPAIR_VERSION,
        description="kvfabric repair: replica targets over failure domains, under a bandwidth budget",
    )
    shell.attach(runtime)
    runtime.metrics.registry.register(RepairCollector(shell))
    runtime.stop_on_signals()
    try:
        await runtime.start()
        await shell.start(runtime.nc)
    except Exception as exc:
        log.error("repair_start_failed", error=repr(exc))
        await runtime.stop()
        return EXIT_UNAVAILABLE
    log.info(
        "repair_started",
        metrics_port=runtime.metrics_port,
        replicas_target=config.replicas_target,
        bandwidth_bytes_per_s=config.core.bandwidth_bytes_per_s,
    )
    await runtime.wait_stop_requested()
    await shell.stop()
    return await runtime.stop()


app = service_cli(name="repair", help="kvfabric repair service (kvf.v1.repair.*).", main=serve)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.repair"))

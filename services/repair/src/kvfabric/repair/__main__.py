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
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.runtime.shells import serve_shell

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
    return await serve_shell(
        runtime,
        shell,
        RepairCollector(shell),
        log,
        replicas_target=config.replicas_target,
        bandwidth_bytes_per_s=config.core.bandwidth_bytes_per_s,
    )


app = service_cli(name="repair", help="kvfabric repair service (kvf.v1.repair.*).", main=serve)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.repair"))

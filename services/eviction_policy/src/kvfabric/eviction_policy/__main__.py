"""Run the eviction-policy service: `python -m kvfabric.eviction_policy --nats-url ... [flags]`.

Policy settings come from the environment (see `kvfabric.eviction_policy.settings`). One
instance per cluster: it follows the directory's event stream and asks the directory to evict.
"""

from __future__ import annotations

import os
import sys
from typing import Final

from kvfabric.core.eviction import EvictionCore
from kvfabric.eviction_policy.handlers import EvictionShell
from kvfabric.eviction_policy.metrics import EvictionCollector
from kvfabric.eviction_policy.settings import load_eviction_settings
from kvfabric.proto.subjects import Service
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings, SettingsError
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import EXIT_UNAVAILABLE, ServiceRuntime

EVICTION_VERSION: Final = "0.1.0"
EXIT_USAGE: Final = 2


async def serve(settings: RuntimeSettings) -> int:
    log = get_logger("kvfabric.eviction_policy")
    try:
        config = load_eviction_settings(os.environ)
    except SettingsError as exc:
        log.error("settings_invalid", error=str(exc))
        return EXIT_USAGE
    shell = EvictionShell(
        EvictionCore(config.core, config.quotas),
        tick_ms=config.tick_ms,
        segments_refresh_ms=config.segments_refresh_ms,
        request_timeout_s=config.request_timeout_s,
    )
    runtime = ServiceRuntime(
        Service.EVICTION,
        settings,
        version=EVICTION_VERSION,
        description="kvfabric eviction policy: watermarks, cost-aware victims, tenant quotas",
    )
    shell.attach(runtime)
    runtime.metrics.registry.register(EvictionCollector(shell))
    runtime.stop_on_signals()
    try:
        await runtime.start()
        await shell.start(runtime.nc)
    except Exception as exc:
        log.error("eviction_start_failed", error=repr(exc))
        await runtime.stop()
        return EXIT_UNAVAILABLE
    log.info("eviction_started", policy=config.core.policy, metrics_port=runtime.metrics_port)
    await runtime.wait_stop_requested()
    await shell.stop()
    return await runtime.stop()


app = service_cli(
    name="eviction-policy", help="kvfabric eviction-policy service (kvf.v1.eviction.*).", main=serve
)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.eviction_policy"))

"""Run the prefetch service: `python -m kvfabric.prefetch --nats-url ... [runtime flags]`.

Settings come from the environment (see `kvfabric.prefetch.settings`). Schedulers send hints
(`kvf.v1.prefetch.hint`); the service copies hinted prefixes next to the engine and gives hot
objects an extra replica.
"""

from __future__ import annotations

import os
import sys
from typing import Final

from kvfabric.core.prefetch import PrefetchCore
from kvfabric.prefetch.metrics import PrefetchCollector
from kvfabric.prefetch.settings import load_prefetch_settings
from kvfabric.prefetch.shell import PrefetchShell
from kvfabric.proto.subjects import Service
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings, SettingsError
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.runtime.shells import serve_shell

PREFETCH_VERSION: Final = "0.1.0"
EXIT_USAGE: Final = 2


async def serve(settings: RuntimeSettings) -> int:
    log = get_logger("kvfabric.prefetch")
    try:
        config = load_prefetch_settings(os.environ)
    except SettingsError as exc:
        log.error("settings_invalid", error=str(exc))
        return EXIT_USAGE
    shell = PrefetchShell(
        PrefetchCore(config.core),
        holder_id=f"prefetch-{settings.instance_id}",
        tick_ms=config.tick_ms,
        scan_ms=config.scan_ms,
        resolving_max=config.resolving_max,
        hot_groups_per_event_max=32,
        request_timeout_s=config.request_timeout_s,
        copy_timeout_s=config.copy_timeout_s,
        group_cache_ms=config.group_cache_ms,
        access_period_ms=config.access_period_ms,
    )
    runtime = ServiceRuntime(
        Service.PREFETCH,
        settings,
        version=PREFETCH_VERSION,
        description="kvfabric prefetch: hinted prefixes next to the engine, hot-object replicas",
    )
    return await serve_shell(runtime, shell, PrefetchCollector(shell), log)


app = service_cli(name="prefetch", help="kvfabric prefetch service (kvf.v1.prefetch.*).", main=serve)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.prefetch"))

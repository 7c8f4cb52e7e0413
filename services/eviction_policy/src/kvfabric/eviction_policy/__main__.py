"""Run the eviction-policy service: `python -m kvfabric.eviction_policy --nats-url ... [flags]`.

Policy settings come from the environment (see `kvfabric.eviction_policy.settings`). One
instance per cluster: it follows the directory's event stream and asks the directory to evict.
"""

from __future__ import annotations

import os
import sys
from typing import Final

from kvfabric.core.eviction import EvictionCore
from kvfabric.eviction_policy.metrics import EvictionCollector
from kvfabric.eviction_policy.settings import load_eviction_settings
from kvfabric.eviction_policy.shell import EvictionShell
from kvfabric.proto.subjects import Service
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings, SettingsError
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.runtime.shells import serve_shell

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
        demote=config.demote,
        demote_min_hits=config.demote_min_hits,
        demote_cut_for_room=config.demote_cut_for_room,
        ssd_high_watermark=config.ssd_high_watermark,
        demote_timeout_s=config.demote_timeout_s,
        admission_publish_ms=config.admission_publish_ms if config.admission else 0,
        decisions_max=config.decisions_max,
    )
    runtime = ServiceRuntime(
        Service.EVICTION,
        settings,
        version=EVICTION_VERSION,
        description="kvfabric eviction policy: watermarks, cost-aware victims, tenant quotas",
    )
    return await serve_shell(runtime, shell, EvictionCollector(shell), log, policy=config.core.policy)


app = service_cli(
    name="eviction-policy", help="kvfabric eviction-policy service (kvf.v1.eviction.*).", main=serve
)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.eviction_policy"))

"""Run the router: `python -m kvfabric.router --nats-url ... [runtime flags]`.

Settings come from the environment (`kvfabric.router.settings`). One process serves:
- the OpenAI-compatible HTTP front (`KVF_ROUTER_HTTP_HOST:PORT`; `kvfabric.router.proxy`) over
  the engines of `KVF_ROUTER_ENGINES`, with its own `/metrics`;
- the NATS micro service `router` with the endpoint `route` (`RouteRequest` -> `RouteReply`:
  answer only, nothing admitted), `$SRV.PING/INFO/STATS`, and the runtime's `/metrics`;
- the index follower (`kvfabric.router.index_follower`) and the engines' health checks.

All of it is `RouterShell` (`kvfabric.router.shell`); this module builds it and runs it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Final

from kvfabric.proto.subjects import Service
from kvfabric.router.metrics import StateCollector
from kvfabric.router.settings import load_router_settings
from kvfabric.router.shell import RouterShell
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings, SettingsError
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import ServiceRuntime
from kvfabric.runtime.shells import serve_shell

ROUTER_VERSION: Final = "0.1.0"
EXIT_USAGE: Final = 2


async def serve(settings: RuntimeSettings) -> int:
    log = get_logger("kvfabric.router")
    for noisy in ("httpx", "httpcore"):  # a line per engine call and health check otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        config = load_router_settings(os.environ)
    except SettingsError as exc:
        log.error("settings_invalid", error=str(exc))
        return EXIT_USAGE
    shell = RouterShell(config)
    runtime = ServiceRuntime(
        Service.ROUTER,
        settings,
        version=ROUTER_VERSION,
        description="kvfabric router: OpenAI-compatible front, cache-aware routing by estimated TTFT",
    )
    collector = StateCollector(shell.core, shell.extra_state)
    return await serve_shell(runtime, shell, collector, log, http_port=config.http_port)


app = service_cli(
    name="router", help="kvfabric router (OpenAI-compatible HTTP front; kvf.v1.router.*).", main=serve
)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.router"))

"""Running a service shell inside a `ServiceRuntime`: the start/serve/stop sequence every
service with a plain shell repeats (eviction policy, repair, prefetch)."""

from __future__ import annotations

from typing import Any, Protocol

from nats.aio.client import Client as NatsClient
from prometheus_client.registry import Collector

from kvfabric.runtime.gcpolicy import freeze_long_lived
from kvfabric.runtime.service import EXIT_UNAVAILABLE, ServiceRuntime

__all__ = ["Shell", "serve_shell"]


class Shell(Protocol):
    def attach(self, runtime: ServiceRuntime) -> None: ...

    async def start(self, nc: NatsClient) -> None: ...

    async def stop(self) -> None: ...


async def serve_shell(
    runtime: ServiceRuntime, shell: Shell, collector: Collector, log: Any, **started_fields: object
) -> int:
    """Attach `shell`'s endpoints and `collector`'s metrics, start both, log
    `<service>_started` (with the metrics port and `started_fields`), freeze what the start built
    out of the GC's walk (`kvfabric.runtime.gcpolicy`), serve until SIGTERM/SIGINT or a fatal
    event, then stop the shell before the runtime. Returns the exit code."""
    shell.attach(runtime)
    runtime.metrics.registry.register(collector)
    runtime.stop_on_signals()
    name = runtime.service.value
    try:
        await runtime.start()
        await shell.start(runtime.nc)
    except Exception as exc:  # any start failure: report, clean up, exit non-zero
        log.error(f"{name}_start_failed", error=repr(exc))
        runtime.request_stop("start_failed")  # arms the stop deadline: a cleanup that hangs exits
        await runtime.stop_serving()  # no handler runs on what the shell's stop releases
        await shell.stop()
        await runtime.stop()
        return EXIT_UNAVAILABLE
    log.info(f"{name}_started", metrics_port=runtime.metrics_port, **started_fields)
    freeze_long_lived(f"{name}_started")
    await runtime.wait_stop_requested()
    await runtime.stop_serving()  # no handler runs on what the shell's stop releases
    await shell.stop()
    return await runtime.stop()

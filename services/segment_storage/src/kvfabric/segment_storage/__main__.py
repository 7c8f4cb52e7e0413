"""Run a segment: `python -m kvfabric.segment_storage --nats-url ... [runtime flags]`.

Segment settings come from the environment (`kvfabric.segment_storage.settings`):
`KVF_SEGMENT_ID` and `KVF_CLUSTER_SECRET` are required. Exit code 75 means the directory declared
this segment down: restart it (it comes back empty under a new incarnation).
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Final

from kvfabric.proto.subjects import Service
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings, SettingsError
from kvfabric.runtime.gcpolicy import freeze_long_lived
from kvfabric.runtime.logs import get_logger
from kvfabric.runtime.service import EXIT_UNAVAILABLE, ServiceRuntime
from kvfabric.segment_storage.arena import ArenaNoSpace, SegmentIdInUse
from kvfabric.segment_storage.metrics import SegmentCollector
from kvfabric.segment_storage.settings import apply_process_settings, load_segment_settings
from kvfabric.segment_storage.shell import EXIT_REREGISTER, SegmentShell
from kvfabric.segment_storage.ssd import SsdFileRefused

SEGMENT_VERSION: Final = "0.1.0"
EXIT_USAGE: Final = 2


async def serve(settings: RuntimeSettings) -> int:
    log = get_logger("kvfabric.segment_storage")
    try:
        config = load_segment_settings(os.environ)
    except SettingsError as exc:
        log.error("settings_invalid", error=str(exc))
        return EXIT_USAGE
    apply_process_settings(config)
    try:
        shell = SegmentShell(config)
    except SegmentIdInUse as exc:
        log.error("segment_id_in_use", error=str(exc))
        return EXIT_USAGE
    except SsdFileRefused as exc:  # another segment's, another configuration's, damaged: never served
        log.error("ssd_file_refused", error=str(exc))
        return EXIT_USAGE
    except ArenaNoSpace as exc:  # often for a while: restarted, it may fit (not when permanent)
        log.error("arena_no_space", error=str(exc), permanent=exc.permanent)
        return EXIT_USAGE if exc.permanent else EXIT_REREGISTER
    runtime = ServiceRuntime(
        Service.SEGMENT,
        settings,
        version=SEGMENT_VERSION,
        description="kvfabric segment: DRAM arena and data plane",
    )
    shell.attach(runtime)
    runtime.metrics.registry.register(SegmentCollector(shell))
    runtime.stop_on_signals()
    try:
        await runtime.start()
        await shell.start(runtime.nc)
    except Exception as exc:  # any start failure: report, clean up, exit non-zero
        log.error("segment_start_failed", error=repr(exc))
        runtime.request_stop("start_failed")  # arms the stop deadline: a cleanup that hangs exits
        await runtime.stop_serving()  # no handler runs on a closed arena
        await shell.stop()
        await runtime.stop()
        return EXIT_UNAVAILABLE
    log.info(
        "segment_started",
        metrics_port=runtime.metrics_port,
        data_addr=shell.data_addr,
        incarnation=shell.incarnation,
        arena=str(shell.arena.path),
        stale_files_removed=[str(p) for p in shell.stale_files_removed],
        ssd=str(shell.ssd.path) if shell.ssd is not None else None,
        ssd_created=shell.ssd.created if shell.ssd is not None else None,
        ssd_recovered_objects=shell.ssd.recovered_objects if shell.ssd is not None else 0,
        ssd_recovered_bytes=shell.ssd.recovered_bytes if shell.ssd is not None else 0,
    )
    freeze_long_lived("segment_started")
    down = asyncio.create_task(shell.must_reregister.wait())
    stop = asyncio.create_task(runtime.wait_stop_requested())
    await asyncio.wait({down, stop}, return_when=asyncio.FIRST_COMPLETED)
    if down.done():
        runtime.request_stop("reregister_required")
    for task in (down, stop):
        task.cancel()
    await runtime.stop_serving()  # no free or copy handler runs on a closed arena
    await shell.stop()
    code = await runtime.stop()
    return EXIT_REREGISTER if shell.must_reregister.is_set() else code


app = service_cli(
    name="segment", help="kvfabric segment storage service (data plane + kvf.v1.segment.*).", main=serve
)

if __name__ == "__main__":
    sys.exit(app(prog_name="python -m kvfabric.segment_storage"))

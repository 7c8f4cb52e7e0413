"""Shared pytest configuration.

- `kvfabric.testing.pytest_plugin`: `nats_server`, `nats_client` (a real nats-server per test).
- `json_logs`: structlog configured to write JSON lines into memory for one test; the value is a
  function returning the records so far. Global logging config is restored afterwards.
- Hypothesis profile `kvfabric`: no per-example deadline and no "input generation is slow"
  health check. Both measure the machine, not the code: on the shared 2-core VMs one draw can
  take a second while other jobs run (a fresh-clone CI failed that check once). Correctness
  properties and example counts are unchanged.
- `_no_gc_policy_leaks` (autouse): a test that ran a service CLI in-process (`service_cli` installs
  the services' GC policy for the process) leaves no policy behind for the next test in the same
  worker. A leaked pause-recording `gc.callbacks` hook once failed a later fuzz test: a
  collection that ran near the recursion limit raised RecursionError inside the hook, which pytest
  reports as an unraisable exception (a fresh-clone CI, xdist worker gw1).
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("kvfabric", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvfabric")

pytest_plugins = ["kvfabric.testing.pytest_plugin"]

# Segments the tests start fault their arena in as writes first touch it, not all at start
# (KVF_SEGMENT_ARENA_PREFAULT, on in a deployment): ~0.7 s of a core per GiB, for each of the
# suite's hundreds of segments. tests/unit/segment_storage/test_arena_files.py runs the prefault
# itself, and test_segment_starts_first.py a segment with it on.
os.environ.setdefault("KVF_SEGMENT_ARENA_PREFAULT", "0")


@pytest.fixture(autouse=True)
def _no_gc_policy_leaks() -> Iterator[None]:
    from kvfabric.runtime import gcpolicy

    yield
    if gcpolicy.installed() is not None or gcpolicy.pauses() is not None:
        gcpolicy.uninstall()


LogRecords = Callable[[], list[dict[str, Any]]]


@pytest.fixture
def json_logs() -> Iterator[LogRecords]:
    import structlog

    from kvfabric.runtime.logs import configure_logging

    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging(level="debug", json=True, stream=stream)

    def records() -> list[dict[str, Any]]:
        return [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]

    try:
        yield records
    finally:
        structlog.reset_defaults()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)

"""The services' GC policy (`kvfabric.runtime.gcpolicy`): installed by the service CLI, thresholds
as configured, pauses recorded and served, long-lived objects frozen out of the collector's walk
(and what an earlier freeze kept that became garbage collected, not leaked)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from kvfabric.runtime import gcpolicy
from kvfabric.runtime.cli import service_cli
from kvfabric.runtime.config import RuntimeSettings
from kvfabric.runtime.metrics import ServiceMetrics
from kvfabric.testing import metric_value


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    gcpolicy.uninstall()
    yield
    gcpolicy.uninstall()


def tracked_ids() -> set[int]:
    return {id(o) for o in gc.get_objects()}


class Node:
    def __init__(self) -> None:
        self.peer: Any = self  # a reference cycle: only the cyclic GC frees it


def test_install_sets_the_thresholds_and_records_each_collection() -> None:
    interpreter = gc.get_threshold()
    policy = gcpolicy.GcPolicy(thresholds=(1234, 11, 12), freeze=True)
    pauses = gcpolicy.install(policy)
    assert gc.get_threshold() == (1234, 11, 12)
    assert gcpolicy.installed() is policy
    gc.collect()
    gc.collect(0)
    assert pauses.count(2) >= 1 and pauses.count(0) >= 1
    assert pauses.sum_s[2] > 0
    gcpolicy.uninstall()
    assert gc.get_threshold() == interpreter
    assert pauses.callback not in gc.callbacks


def test_freeze_takes_what_is_alive_out_of_the_walk_only_under_the_policy() -> None:
    state = [[i] for i in range(100)]  # tracked containers
    assert gcpolicy.freeze_long_lived("test") is None  # not installed: nothing frozen
    assert id(state) in tracked_ids()

    gcpolicy.install()
    took_s = gcpolicy.freeze_long_lived("test")
    assert took_s is not None and took_s > 0
    walked = tracked_ids()
    assert id(state) not in walked and id(state[0]) not in walked
    assert gc.get_freeze_count() > 100
    later = [1]
    assert id(later) in tracked_ids()  # objects made after the freeze are walked as usual


def test_a_later_freeze_collects_frozen_cycles_that_became_garbage() -> None:
    gcpolicy.install()
    old = Node()  # e.g. a replaced directory core: its quotas hold a bound method of it
    gone = weakref.ref(old)
    gcpolicy.freeze_long_lived("first")
    del old
    gc.collect()
    assert gone() is not None  # frozen: no collection sees the cycle
    gcpolicy.freeze_long_lived("rebuilt")
    assert gone() is None  # unfrozen, collected, then the rest frozen again


def test_a_policy_that_does_not_freeze_freezes_nothing() -> None:
    gcpolicy.install(gcpolicy.GcPolicy(thresholds=(700, 10, 10), freeze=False))
    assert gcpolicy.freeze_long_lived("test") is None
    assert gc.get_freeze_count() == 0


def test_metrics_serve_the_pauses_and_frozen_objects_once_installed() -> None:
    before = ServiceMetrics("directory").exposition().decode()
    assert "kvfabric_directory_gc_pause_seconds" not in before  # not recorded: not shown

    gcpolicy.install()
    gc.collect()
    gcpolicy.freeze_long_lived("test")
    text = ServiceMetrics("directory").exposition().decode()
    count = metric_value(text, "kvfabric_directory_gc_pause_seconds_count", generation="2")
    assert count is not None and count >= 2
    assert (
        metric_value(text, "kvfabric_directory_gc_pause_seconds_bucket", generation="2", le="+Inf") == count
    )
    assert metric_value(text, "kvfabric_directory_gc_pause_seconds_count", generation="0") is not None
    frozen = metric_value(text, "kvfabric_directory_gc_frozen_objects")
    assert frozen is not None and frozen > 0


def test_the_service_cli_runs_main_under_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI would point logging at CliRunner's stream, closed once it returns.
    monkeypatch.setattr("kvfabric.runtime.cli.configure_logging", lambda **_: None)
    seen: list[tuple[gcpolicy.GcPolicy | None, tuple[int, int, int]]] = []

    async def main(settings: RuntimeSettings) -> int:
        seen.append((gcpolicy.installed(), gc.get_threshold()))
        return 0

    result = CliRunner().invoke(
        service_cli(name="probe", help="probe", main=main), ["--metrics-port", "-1"], env={}
    )
    assert result.exit_code == 0, result.output
    assert seen == [(gcpolicy.SERVICE_GC_POLICY, gcpolicy.SERVICE_GC_POLICY.thresholds)]

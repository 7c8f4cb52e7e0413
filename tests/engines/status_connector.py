"""Test connector: `KvfabricConnector` reporting what the engine sees of its cache. Each side
appends one JSON line to `$KVF_TEST_STATUS_REPORT` when it is built (`role`, `init_s`: how long
the connector took to build, i.e. what it adds to vLLM's start-up), the scheduler one more after
a finished request when its client's status or fallbacks changed (`seen`, `seen_fallbacks`), and
each one more when vLLM shuts it down (`status` of its client, `fallbacks` by cause: the worker's
count failed loads).

Loaded by `kvfabric.testing.vllm_run --kvfabric-class tests.engines.status_connector:StatusConnector`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Final

from kvfabric.engines.vllm_connector import KvfabricConnector

REPORT_ENV: Final = "KVF_TEST_STATUS_REPORT"


def _append(line: dict[str, Any]) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


class StatusConnector(KvfabricConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        super().__init__(*args, **kwargs)
        _append({"role": self.role.name.lower(), "init_s": time.perf_counter() - started})
        self._seen: tuple[dict[str, Any], dict[str, float]] | None = None

    def _snapshot(self) -> tuple[dict[str, Any], dict[str, float]]:
        fallbacks = {
            sample.labels["cause"]: sample.value
            for metric in self.client.metrics.fallbacks.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        }
        return dataclasses.asdict(self.client.status), fallbacks

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # the scheduler's status as of each finished request, when it changed: the shutdown
        # line may never come (vLLM kills an engine core not stopped within its timeout)
        answer = super().request_finished(request, block_ids)
        snapshot = self._snapshot()
        if snapshot != self._seen:
            self._seen = snapshot
            _append({"role": self.role.name.lower(), "seen": snapshot[0], "seen_fallbacks": snapshot[1]})
        return answer

    def shutdown(self) -> None:
        status, fallbacks = self._snapshot()
        _append({"role": self.role.name.lower(), "status": status, "fallbacks": fallbacks})
        super().shutdown()


def read_report(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class PolicyReadFirstConnector(StatusConnector):
    """Leaves `kv_load_failure_policy` as configured: what a vLLM that reads the policy before it
    builds the connector would do. The connector's check must then refuse to start."""

    @staticmethod
    def _recompute_failed_loads(vllm_config: Any) -> str | None:
        return getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", None)

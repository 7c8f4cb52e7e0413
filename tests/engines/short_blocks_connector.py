"""Test connector: `KvfabricConnector` planning loads from a block list shorter than the one vLLM
allocated (the block-list/hit mismatch of issue 20, item 6, forced). The scheduler side writes
its client's fallback counters to `$KVF_TEST_CONNECTOR_REPORT` each time it plans a load, where
the mismatch is counted (not at shutdown: vLLM's process manager may kill the engine core before
its scheduler's shutdown runs, and then the report was missing although the counting was right).

Loaded by `kvfabric.testing.vllm_run --kvfabric-class
tests.engines.short_blocks_connector:ShortBlocksConnector` (vLLM's engine processes import it:
they inherit the runner's sys.path, which holds the repository root).
"""

from __future__ import annotations

import json
import os
from typing import Final

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvfabric.engines.vllm_connector import KvfabricConnector, KvfabricMetadata, _Request

BLOCKS_SEEN: Final = 5  # of a request's blocks, the connector sees only the first ones
REPORT_ENV: Final = "KVF_TEST_CONNECTOR_REPORT"


class ShortBlocksConnector(KvfabricConnector):
    def _plan_load(self, meta: KvfabricMetadata, req_id: str, state: _Request) -> None:
        short = _Request(state.token_ids, state.block_ids[:BLOCKS_SEEN], state.stored_chunks)
        super()._plan_load(meta, req_id, short)
        state.stored_chunks = short.stored_chunks
        self._write_report()

    def _write_report(self) -> None:
        path = os.environ.get(REPORT_ENV)
        if path and self.role == KVConnectorRole.SCHEDULER:
            fallbacks = {
                sample.labels["cause"]: sample.value
                for metric in self.client.metrics.fallbacks.collect()
                for sample in metric.samples
                if sample.name.endswith("_total")
            }
            with open(path + ".tmp", "w") as f:
                json.dump({"fallbacks": fallbacks}, f)
            os.replace(path + ".tmp", path)

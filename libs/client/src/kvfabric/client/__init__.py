"""kvfabric client: what engines link.

- `KvClient` (sync facade, its own loop thread) and `AsyncKvClient`: `lookup` -> `Hit` (folded,
  read-leased), `load` -> `LoadResult` (verified prefix), `save`/`save_async` (two-phase
  publish), `release`; `save_memory` -> `SaveMemory` (memory a co-located save reads in place).
- `EngineSpec`: domain + model + layout (+ required members) naming an engine's keys.
- `ClientSettings` / `settings_from_env`: the cluster address and every limit.
"""

from kvfabric.client.aio import AsyncKvClient, Destination, EngineSpec, Source
from kvfabric.client.hits import Hit, LoadResult, SaveResult
from kvfabric.client.metrics import ClientMetrics
from kvfabric.client.save_memory import SaveMemory
from kvfabric.client.settings import ClientSettings, settings_from_env
from kvfabric.client.sync import KvClient

__all__ = [
    "AsyncKvClient",
    "ClientMetrics",
    "ClientSettings",
    "Destination",
    "EngineSpec",
    "Hit",
    "KvClient",
    "LoadResult",
    "SaveMemory",
    "SaveResult",
    "Source",
    "settings_from_env",
]

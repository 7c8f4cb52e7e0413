"""`kvfabric_segment_rejected_connections_total` counts the data connections refused `busy` by
either transport: it read the TCP server's count only, so a segment serving UCX too left every
UCX refusal out (docs/metrics.md: "data connections refused (limit)")."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvfabric.segment_storage.metrics import rejected_connections


def shell(tcp: int, ucx: int | None, started: bool = True) -> Any:
    server = SimpleNamespace(rejected_busy=tcp)
    if ucx is None:
        return SimpleNamespace(server=server, ucx=None)
    return SimpleNamespace(
        server=server, ucx=SimpleNamespace(server=SimpleNamespace(rejected_busy=ucx) if started else None)
    )


def test_busy_refusals_of_both_transports_are_counted() -> None:
    assert rejected_connections(shell(3, 4)) == 7
    assert rejected_connections(shell(3, None)) == 3  # no UCX
    assert rejected_connections(shell(3, 4, started=False)) == 3  # UCX not started (yet)

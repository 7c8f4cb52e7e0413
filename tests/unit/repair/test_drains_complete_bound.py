"""The repair status's list of completed drains names each segment once, the latest
`DRAINS_COMPLETE_KEPT` (a drain flag that flapped appended the segment at every drain, for the
service's life; review, stop 68)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from kvfabric.core.repair import DrainComplete
from kvfabric.repair import shell as repair_shell
from kvfabric.repair.shell import RepairShell


def test_completed_drains_are_named_once_and_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(repair_shell, "DRAINS_COMPLETE_KEPT", 3)
    sh = RepairShell.__new__(RepairShell)
    sh.drains_complete = []
    sh._log = cast(Any, type("Log", (), {"info": staticmethod(lambda *a, **k: None)})())

    async def perform(effect: DrainComplete) -> None:
        await sh._perform(effect)

    for segment in ("a", "b", "a", "c", "d", "a"):
        asyncio.run(perform(DrainComplete(segment)))
    assert sh.drains_complete == ["c", "d", "a"]

"""A logger for tests that keeps what it is asked to log (a structlog logger's call shape)."""

from __future__ import annotations

from typing import Any

__all__ = ["RecordingLog"]


class RecordingLog:
    """Keeps every `log.<level>(event, **fields)` as (level, event, fields) in `lines`."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.lines.append((level, event, fields))

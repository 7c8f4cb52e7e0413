"""Every message family, by name: the input of `make schemas` and the golden-message tests."""

from __future__ import annotations

from typing import Any, Final

from kvfabric.proto import common, dataplane, directory, echo, eviction, prefetch, repair, router, segment

__all__ = ["FAMILIES"]

# family name -> the type (tagged union or Struct) decoded for it.
FAMILIES: Final[dict[str, Any]] = {
    "common.error": common.ErrorReply,
    "echo": echo.EchoMessage,
    "directory.request": directory.DirectoryRequest,
    "directory.reply": directory.DirectoryReply,
    "directory.event": directory.DirectoryEvent,
    "segment": segment.SegmentMessage,
    "dataplane": dataplane.DataplaneMeta,
    "eviction": eviction.EvictionMessage,
    "repair": repair.RepairMessage,
    "prefetch": prefetch.PrefetchMessage,
    "router": router.RouterMessage,
}

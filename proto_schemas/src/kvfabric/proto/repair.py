"""Messages of the `repair` service (subjects `kvf.v1.repair.<verb>`).

One verb for operators and tests: `status` (`RepairStatusRequest` → `RepairStatus`).
"""

from __future__ import annotations

import msgspec

from kvfabric.proto.codec import FamilyDecoder

__all__ = ["RepairMessage", "RepairStatus", "RepairStatusRequest", "repair_decoder"]


class RepairStatusRequest(msgspec.Struct, frozen=True, kw_only=True, tag="repair.status.v1", tag_field="t"):
    """Ask the service for its progress (no fields)."""


class RepairStatus(msgspec.Struct, frozen=True, kw_only=True, tag="repair.status_reply.v1", tag_field="t"):
    scans: int  # anti-entropy passes done
    below_target: int  # objects below their replica target at the last pass
    bytes_copied: int
    drains_complete: list[str]
    gauges: dict[str, int]  # the core's: copies/bytes in flight, objects stuck, ...
    counters: dict[str, int]


RepairMessage = RepairStatusRequest | RepairStatus

repair_decoder: FamilyDecoder[RepairMessage] = FamilyDecoder(RepairMessage, "repair")

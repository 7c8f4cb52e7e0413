"""Golden wire messages: one or more per family, pinned forever as bytes in proto_schemas/golden/.

`tools/gen_golden.py` writes the bytes of a case once (it never overwrites a file). The tests
decode every stored file with its family's decoder and compare it to the value here, so a change
that breaks old encodings (renamed field, changed type or tag) fails. Add a case for each new
message; never edit or delete an existing one (bump the tag version instead).
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvfabric.proto import common, echo

__all__ = ["GOLDEN_CASES"]

# case name -> (family name in registry.FAMILIES, expected decoded value)
GOLDEN_CASES: Final[dict[str, tuple[str, msgspec.Struct]]] = {
    "common.error.busy": (
        "common.error",
        common.ErrorReply(code="busy", message="in-flight limit 64 reached", retryable=True, details={"limit": 64}),
    ),
    "echo.say.v1": ("echo", echo.EchoRequest(text="hello", delay_ms=5)),
    "echo.said.v1": ("echo", echo.EchoReply(text="hello", instance_id="echo-1")),
}

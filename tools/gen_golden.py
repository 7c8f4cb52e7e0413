"""Write the golden encoded message of every case that has no file yet. Never overwrites.

python tools/gen_golden.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvfabric.proto.codec import encode
from kvfabric.proto.golden_cases import GOLDEN_CASES

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "proto_schemas" / "golden"


def main() -> int:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    written = 0
    for name, (_family, value) in sorted(GOLDEN_CASES.items()):
        path = GOLDEN_DIR / f"{name}.msgpack"
        if path.exists():
            continue
        path.write_bytes(encode(value))
        written += 1
        print(f"wrote {path.relative_to(GOLDEN_DIR.parent.parent)}")
    print(f"{written} new golden file(s); {len(GOLDEN_CASES) - written} already pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generate (or check) the JSON Schema files of every wire message family.

    python tools/gen_schemas.py --write   # make schemas
    python tools/gen_schemas.py --check   # make schemas-check: exit 1 when a file is stale

Output: proto_schemas/jsonschema/<family>.json, one per entry of `kvfabric.proto.registry.FAMILIES`,
plus subjects.json listing every endpoint subject. The files are checked in, so a wire change shows
up in review as a schema diff.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

from kvfabric.proto.registry import FAMILIES
from kvfabric.proto.subjects import PROTOCOL_VERSION, Service, event_subject, service_group

OUT_DIR = Path(__file__).resolve().parent.parent / "proto_schemas" / "jsonschema"


def render() -> dict[str, str]:
    files: dict[str, str] = {}
    for name, family in sorted(FAMILIES.items()):
        schema = msgspec.json.schema(family)
        schema["$comment"] = (
            f"kvfabric wire family {name!r}, protocol v{PROTOCOL_VERSION}. Generated: do not edit."
        )
        files[f"{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    subjects = {
        "protocol_version": PROTOCOL_VERSION,
        "services": {s.value: service_group(s) for s in Service},
        "events_example": event_subject(Service.DIRECTORY, "published"),
    }
    files["subjects.json"] = json.dumps(subjects, indent=2, sort_keys=True) + "\n"
    return files


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args()

    wanted = render()
    present = {p.name for p in OUT_DIR.glob("*.json")}
    if args.write:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        for stale in present - wanted.keys():
            (OUT_DIR / stale).unlink()
        for fname, text in wanted.items():
            (OUT_DIR / fname).write_text(text)
        print(f"wrote {len(wanted)} schema files to {OUT_DIR}")
        return 0

    problems = [f"extra file {f} (family removed?)" for f in sorted(present - wanted.keys())]
    for fname, text in sorted(wanted.items()):
        path = OUT_DIR / fname
        if not path.exists():
            problems.append(f"missing {fname}")
        elif path.read_text() != text:
            problems.append(f"stale {fname}")
    if problems:
        print(
            "JSON Schemas are out of date; run `make schemas` and commit:",
            *problems,
            sep="\n  ",
            file=sys.stderr,
        )
        return 1
    print(f"{len(wanted)} schema files up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Golden encoded messages decode to their pinned values; every family has one."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvfabric.format.errors import BadRequest
from kvfabric.proto.codec import FamilyDecoder, encode
from kvfabric.proto.golden_cases import GOLDEN_CASES
from kvfabric.proto.registry import FAMILIES

GOLDEN_DIR = Path(__file__).resolve().parents[3] / "proto_schemas" / "golden"


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_file_decodes_to_pinned_value(name: str) -> None:
    family, expected = GOLDEN_CASES[name]
    path = GOLDEN_DIR / f"{name}.msgpack"
    assert path.exists(), f"no golden file for {name}: run tools/gen_golden.py and commit it"
    decoded: object = FamilyDecoder(FAMILIES[family], family).decode(path.read_bytes())
    assert decoded == expected


def test_every_family_has_a_golden_case() -> None:
    covered = {family for family, _ in GOLDEN_CASES.values()}
    assert covered == set(FAMILIES)


def test_every_golden_file_has_a_case() -> None:
    files = {p.stem for p in GOLDEN_DIR.glob("*.msgpack")}
    assert files == set(GOLDEN_CASES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_round_trips_and_rejects_garbage(family: str) -> None:
    decoder: FamilyDecoder[object] = FamilyDecoder(FAMILIES[family], family)
    for case_family, value in GOLDEN_CASES.values():
        if case_family == family:
            assert decoder.decode(encode(value)) == value
    with pytest.raises(BadRequest, match=f"malformed {family}"):
        decoder.decode(b"\xc1not msgpack")
    with pytest.raises(BadRequest):
        decoder.decode(msgspec.msgpack.encode({"t": "no.such.tag.v9"}))

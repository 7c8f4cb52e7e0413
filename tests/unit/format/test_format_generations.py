"""Generations fence stale actors; kinds never mix."""

from __future__ import annotations

from typing import Any

import pytest

from kvfabric.format import (
    GENERATION_MAX,
    DirectoryEpoch,
    Generation,
    RequestGeneration,
    SegmentIncarnation,
    SlotGeneration,
    is_stale,
)

KINDS = [DirectoryEpoch, SegmentIncarnation, SlotGeneration, RequestGeneration]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_order_within_a_kind(kind: type[Generation]) -> None:
    a, b = kind(3), kind(4)
    assert a < b
    assert a <= b
    assert b > a
    assert b >= a
    assert a == kind(3)
    assert a != b
    assert a.next() == b
    assert type(a.next()) is kind
    assert int(b) == b.value == 4
    assert hash(a) == hash(kind(3))
    assert repr(a) == f"{kind.__name__}(3)"


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "=="])
def test_mixing_kinds_raises_type_error(op: str) -> None:
    a: Any = DirectoryEpoch(1)
    b: Any = SlotGeneration(1)
    with pytest.raises(TypeError, match="cannot compare directory_epoch with SlotGeneration"):
        eval(f"a {op} b", {"a": a, "b": b})


def test_kinds_are_distinct_as_dict_keys_and_never_equal_plain_ints() -> None:
    assert hash(DirectoryEpoch(1)) != hash(SlotGeneration(1))
    assert DirectoryEpoch(1) != 1
    with pytest.raises(TypeError):
        is_stale(DirectoryEpoch(1), SegmentIncarnation(2))


def test_is_stale() -> None:
    assert is_stale(SlotGeneration(4), SlotGeneration(5))
    assert not is_stale(SlotGeneration(5), SlotGeneration(5))
    # A receiver that is behind is not fenced by this check.
    assert not is_stale(DirectoryEpoch(6), DirectoryEpoch(5))


def test_range_and_type_are_checked() -> None:
    assert DirectoryEpoch(GENERATION_MAX).value == 2**64 - 1
    assert DirectoryEpoch(0).value == 0
    with pytest.raises(ValueError, match="out of range"):
        DirectoryEpoch(2**64)
    with pytest.raises(ValueError, match="out of range"):
        DirectoryEpoch(-1)
    with pytest.raises(ValueError, match="out of range"):
        DirectoryEpoch(GENERATION_MAX).next()
    with pytest.raises(TypeError, match="must be an int"):
        SlotGeneration(True)
    with pytest.raises(TypeError, match="must be an int"):
        SlotGeneration(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="abstract"):
        Generation(1)


def test_generations_are_immutable() -> None:
    g = DirectoryEpoch(1)
    with pytest.raises(AttributeError):
        g.other = 2  # type: ignore[attr-defined]

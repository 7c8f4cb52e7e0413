"""The error hierarchy: wire codes round-trip with their type, codes are unique."""

from __future__ import annotations

import pytest

from kvfabric.format import errors
from kvfabric.format.errors import (
    BadRequest,
    Exists,
    InFlight,
    KvfError,
    StaleGeneration,
    UnsupportedVersion,
    error_class_for_code,
    error_from_wire,
)

ALL_CLASSES = [
    cls
    for name in errors.__all__
    if isinstance(cls := getattr(errors, name), type) and issubclass(cls, KvfError)
]


def test_every_exported_error_has_a_unique_code() -> None:
    codes = [cls.code for cls in ALL_CLASSES]
    assert len(codes) == len(set(codes))
    assert len(ALL_CLASSES) >= 15


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_error_from_wire_keeps_the_type_message_and_details(cls: type[KvfError]) -> None:
    err = error_from_wire(cls.code, "it went wrong", {"key": "kvf1:...", "n": 3})
    assert type(err) is cls
    assert err.message == "it went wrong"
    assert str(err) == "it went wrong"
    assert err.details == {"key": "kvf1:...", "n": 3}
    assert err.retryable is cls.retryable
    assert err.status == cls.status
    assert error_class_for_code(cls.code) is cls


def test_unknown_code_maps_to_the_root_error() -> None:
    err = error_from_wire("from_a_newer_build", "??")
    assert type(err) is KvfError
    assert err.details == {}
    assert error_class_for_code("nope") is KvfError


def test_subclasses_are_caught_by_their_parents() -> None:
    with pytest.raises(BadRequest):
        raise error_from_wire("unsupported_version", "x", {"found": 2})
    assert isinstance(error_from_wire("exists", "x"), errors.Conflict)
    assert InFlight.retryable
    assert not Exists.retryable


def test_structured_errors_carry_their_fields() -> None:
    e = UnsupportedVersion("manifest format", 3, (1, 2))
    assert str(e) == "unsupported manifest format version 3; this build reads 1, 2"
    assert e.details == {"what": "manifest format", "found": 3, "supported": [1, 2]}
    s = StaleGeneration("directory_epoch", 4, 5)
    assert str(s) == "stale directory_epoch: saw 4, current is 5"
    assert s.details == {"kind": "directory_epoch", "seen": 4, "current": 5}
    assert "StaleGeneration" in repr(s)
    assert "stale_generation" in repr(s)


def test_a_duplicate_wire_code_is_refused_at_class_creation() -> None:
    with pytest.raises(TypeError, match="duplicate wire code 'exists'"):

        class AlsoExists(KvfError):
            code = "exists"

    assert error_class_for_code("exists") is Exists


def test_an_unknown_code_keeps_the_wire_retryable_flag() -> None:
    """A newer peer's code this build does not know read non-retryable whatever the reply said:
    a transient refusal treated as permanent (review, stop 68)."""
    from kvfabric.proto.common import ErrorReply, error_from_reply

    later = error_from_reply(ErrorReply(code="a_newer_code", message="m", retryable=True))
    assert type(later) is KvfError and later.retryable
    assert not error_from_reply(ErrorReply(code="a_newer_code", message="m")).retryable
    assert not KvfError("m").retryable  # the class is untouched
    busy = error_from_reply(ErrorReply(code="busy", message="m", retryable=False))
    assert busy.retryable  # a known code keeps its class's flag

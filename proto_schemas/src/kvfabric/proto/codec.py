"""Encoding on the wire: msgpack through msgspec, one typed decoder per message family.

Decode failures (not msgpack, wrong shape, unknown tag, bad field type, nesting deeper than the
recursion limit) become `BadRequest` with msgspec's path in the message, so a handler answers a
typed error and stays up.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from kvfabric.format.errors import BadRequest

__all__ = ["FamilyDecoder", "decode_as", "encode"]

T = TypeVar("T")
M = TypeVar("M", bound=msgspec.Struct)

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    """msgpack bytes of one message."""
    return _encoder.encode(message)


class FamilyDecoder(Generic[T]):
    """Decodes one message family (a tagged union, or a single Struct) and nothing else."""

    def __init__(self, family: Any, name: str) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(family)
        self.name = name

    def decode(self, data: bytes | bytearray | memoryview) -> T:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadRequest(f"malformed {self.name} message: {exc}", family=self.name) from exc
        except RecursionError:  # a msgpack "bomb" of nested arrays/maps, even in a skipped field
            raise BadRequest(f"malformed {self.name} message: nested too deep", family=self.name) from None


def decode_as(
    decoder: FamilyDecoder[Any], data: bytes | bytearray | memoryview, kind: type[M], verb: str = ""
) -> M:
    """`data` decoded by `decoder` as a `kind`, the one message an endpoint takes: any other
    message of the family, like a malformed one, is `BadRequest` ("<verb> takes <kind>, got
    <type>"; "expected <kind>, got <type>" without a verb)."""
    message = decoder.decode(data)
    if not isinstance(message, kind):
        wanted = f"{verb} takes {kind.__name__}" if verb else f"expected {kind.__name__}"
        raise BadRequest(f"{wanted}, got {type(message).__name__}")
    return message

"""Fuzz: every message-family decoder, the client's error-reply path and the manifest decoder.

Contract: any bytes decode to a value of the family's type (which re-encodes to bytes that decode
to the same value) or raise `BadRequest` — never another exception, so a handler always answers
a typed error and stays up. Inputs: raw bytes, and the corpus (golden messages, hand-made
malformed ones, past crashes) mutated byte-wise and field-wise (wrong types, retagged, nested).
"""

from __future__ import annotations

import gc
import tracemalloc
import types
import typing
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.cluster.requests import error_from_response
from kvfabric.format.errors import BadRequest, KvfError
from kvfabric.format.manifest import complete_prefix_len, decode_manifest, encode_manifest
from kvfabric.proto.codec import FamilyDecoder, encode
from kvfabric.proto.common import (
    ERROR_CODE_HEADER,
    NATS_SERVICE_ERROR_CODE_HEADER,
    NATS_SERVICE_ERROR_HEADER,
    ErrorReply,
    error_from_reply,
)
from kvfabric.proto.registry import FAMILIES

from .fuzzkit import corpus, corpus_params, fuzz_settings, mutated, saving_crash


def _members(family: Any) -> tuple[type[msgspec.Struct], ...]:
    if isinstance(family, types.UnionType) or typing.get_origin(family) is typing.Union:
        return typing.get_args(family)
    return (family,)


DECODERS: Final = {name: FamilyDecoder[Any](family, name) for name, family in FAMILIES.items()}
TYPES: Final = {name: _members(family) for name, family in FAMILIES.items()}
TAGS: Final = sorted(
    {str(t.__struct_config__.tag) for members in TYPES.values() for t in members if t.__struct_config__.tag}
)
DECODER_SEEDS: Final = [p.read_bytes() for p in corpus("decoders")]
MANIFEST_SEEDS: Final = [p.read_bytes() for p in corpus("manifest")]
ERROR_HEADERS: Final = {
    NATS_SERVICE_ERROR_CODE_HEADER: "500",
    NATS_SERVICE_ERROR_HEADER: "boom",
    ERROR_CODE_HEADER: "busy",
}


def check_families(data: bytes) -> None:
    for name, decoder in DECODERS.items():
        try:
            value = decoder.decode(data)
        except BadRequest:
            continue
        assert isinstance(value, TYPES[name]), f"{name} decoded a {type(value).__name__}"
        try:
            again = encode(value)
        except RecursionError:
            # Only an `Any` field (error details) holds arbitrary nesting: a value just under the
            # recursion limit decodes but need not re-encode (no service echoes details).
            assert name == "common.error", f"{name}: a decoded value does not re-encode"
            continue
        assert encode(decoder.decode(again)) == again, f"{name}: re-encoding is not stable"
        if isinstance(value, ErrorReply):
            assert isinstance(error_from_reply(value), KvfError)
    # How a client reads an error reply: body first, headers as the fallback.
    assert isinstance(error_from_response(ERROR_HEADERS, data), KvfError)


def check_manifest(data: bytes) -> None:
    try:
        manifest = decode_manifest(data)
    except BadRequest:
        return
    again = encode_manifest(manifest)
    assert decode_manifest(again) == manifest
    assert 0 <= complete_prefix_len(manifest, [(0, 0, 0)]) <= len(manifest.chunks)


@pytest.mark.parametrize("path", corpus_params("decoders"))
def test_decoders_corpus(path: Path) -> None:
    check_families(path.read_bytes())


@pytest.mark.parametrize("path", corpus_params("manifest"))
def test_manifest_corpus(path: Path) -> None:
    check_manifest(path.read_bytes())


@fuzz_settings(300)
@given(st.binary(max_size=256))
def test_decoders_take_any_bytes(data: bytes) -> None:
    with saving_crash("decoders", data):
        check_families(data)


@fuzz_settings(1000)
@given(mutated(DECODER_SEEDS, TAGS))
def test_decoders_take_mutated_messages(data: bytes) -> None:
    with saving_crash("decoders", data):
        check_families(data)


@fuzz_settings(400)
@given(st.binary(max_size=256) | mutated(MANIFEST_SEEDS))
def test_manifest_decoder_takes_any_bytes(data: bytes) -> None:
    with saving_crash("manifest", data):
        check_manifest(data)


def test_decoding_garbage_leaks_no_memory() -> None:
    """Refused inputs (exceptions with tracebacks, partial values) leave nothing behind."""
    inputs = [*DECODER_SEEDS, *MANIFEST_SEEDS, b"\x82\xa1t\xa3bad\xa1x" * 50]

    def one_pass() -> None:
        for data in inputs:
            check_families(data)
            check_manifest(data)

    one_pass()  # warm caches (interned strings, msgspec type info)
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20):
            one_pass()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes still allocated after 20 passes over the corpus"

"""Shared pieces of the fuzz targets: example budgets, the checked-in corpus, byte mutations.

- `examples(n)`: a target's per-run example count, scaled by `KVF_FUZZ_EXAMPLES` (a multiplier,
  default 1; `KVF_FUZZ_EXAMPLES=20` for a long local run).
- `corpus(target)`: the files of `corpus/<target>/`, replayed by every run (pytest params) and used
  as the seeds that `mutated()` starts from.
- `saving_crash(target, data)`: wraps one check; when Hypothesis replays its minimal failing input
  (or an explicit example) the input is written to `corpus/<target>/crash-<digest>.bin` and the
  exception says where. Commit that file with the fix: from then on every run replays it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.control import current_build_context
from hypothesis.errors import InvalidArgument

__all__ = [
    "CORPUS_DIR",
    "corpus",
    "corpus_params",
    "examples",
    "fuzz_settings",
    "hostile_values",
    "mutated",
    "saving_crash",
    "wide_ints",
]

CORPUS_DIR: Final = Path(__file__).resolve().parent / "corpus"
_SCALE_ENV: Final = "KVF_FUZZ_EXAMPLES"
NEST_DEPTH_MAX: Final = 5_000  # deeper than any recursion limit: a msgpack "bomb" of nested arrays
INTERESTING_BYTES: Final = (
    0x00,
    0x01,
    0x7F,
    0x80,
    0x90,
    0xA0,
    0xC0,
    0xC1,
    0xC4,
    0xCF,
    0xD3,
    0xDD,
    0xDF,
    0xFF,
)


def examples(n: int) -> int:
    """`n` times the `KVF_FUZZ_EXAMPLES` multiplier (at least 1)."""
    raw = os.environ.get(_SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"{_SCALE_ENV} must be a number (a multiplier), got {raw!r}") from None
    return max(1, round(n * scale))


def fuzz_settings(n: int) -> settings:
    """Settings of one fuzz target: `examples(n)` examples, no per-example deadline (shared CI
    cores), a failure blob to reproduce with `@reproduce_failure`."""
    return settings(
        max_examples=examples(n),
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def corpus(target: str) -> list[Path]:
    """Every input of `corpus/<target>/`, sorted by name."""
    return sorted(p for p in (CORPUS_DIR / target).iterdir() if p.is_file() and not p.name.startswith("."))


def corpus_params(target: str) -> list[Any]:
    """`corpus(target)` as pytest params with readable ids."""
    return [pytest.param(p, id=p.name) for p in corpus(target)]


def _is_final_run() -> bool:
    try:
        return current_build_context().is_final
    except InvalidArgument:  # not inside a Hypothesis test (a plain corpus replay)
        return False


@contextmanager
def saving_crash(target: str, data: bytes | Callable[[], bytes]) -> Iterator[None]:
    """Run a check; on Hypothesis' final (minimal) failing input, keep `data` in the corpus (a
    callable is asked for the bytes after the failure: an input drawn while the check ran)."""
    try:
        yield
    except BaseException as exc:
        if _is_final_run():
            if callable(data):
                data = data()
            path = CORPUS_DIR / target / f"crash-{hashlib.blake2b(data, digest_size=6).hexdigest()}.bin"
            if not path.exists():
                path.write_bytes(data)
            exc.add_note(f"fuzz input saved as {path.relative_to(CORPUS_DIR.parents[2])}: commit it")
        raise


# ---- hostile values and mutations ---------------------------------------------------------------

_INT_EDGES: Final = (
    0,
    1,
    -1,
    255,
    256,
    65_535,
    65_536,
    2**31 - 1,
    2**32 - 1,
    2**32,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
)


def wide_ints() -> st.SearchStrategy[int]:
    """Any int msgpack can carry (int64 and uint64), edges first."""
    return st.one_of(st.sampled_from(_INT_EDGES), st.integers(-(2**63), 2**64 - 1))


def _nested(depth: int) -> msgspec.Raw:
    return msgspec.Raw(b"\x91" * depth + b"\xc0")


def hostile_values() -> st.SearchStrategy[Any]:
    """Values a field may carry on the wire but no schema expects (wrong type, edge, bomb)."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        wide_ints(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
        st.binary(max_size=8),
        st.just("x" * 5000),
        st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=12)),
        st.integers(1, NEST_DEPTH_MAX).map(_nested),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=6,
    )


def _containers(obj: Any, depth: int = 0) -> list[tuple[Any, Any]]:
    """(container, key) of every slot inside a decoded msgpack value (dicts and lists), shallow first."""
    out: list[tuple[Any, Any]] = []
    if depth > 6:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((obj, k))
            out.extend(_containers(v, depth + 1))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((obj, i))
            out.extend(_containers(v, depth + 1))
    return out


@st.composite
def _field_mutation(draw: st.DrawFn, seed: bytes, tags: Sequence[str]) -> bytes:
    """Decode `seed` as plain msgpack and change one thing inside: a value's type, a tag, a field
    dropped or added; re-encode. Seeds that are not msgpack are returned unchanged."""
    try:
        value = msgspec.msgpack.decode(seed)
    except (msgspec.DecodeError, RecursionError):
        return seed
    slots = _containers(value)
    action = draw(st.sampled_from(["replace", "drop", "add", "retag"]))
    if action == "retag" and isinstance(value, dict) and tags:
        value["t"] = draw(st.sampled_from(tags))
    elif action == "add" and isinstance(value, dict):
        value[draw(st.sampled_from(["t", "zz", "", "epoch", "objects"]))] = draw(hostile_values())
    elif slots:
        container, k = draw(st.sampled_from(slots))
        if action == "drop":
            del container[k]
        else:
            container[k] = draw(hostile_values())
    try:
        return msgspec.msgpack.encode(value)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return seed


@st.composite
def _byte_mutation(draw: st.DrawFn, seed: bytes, others: Sequence[bytes]) -> bytes:
    """One byte-level change: flip, set, insert, delete, truncate, splice, nest."""
    data = bytearray(seed)
    action = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "splice", "nest"]))
    pos = draw(st.integers(0, len(data)))
    if action == "flip" and data:
        i = min(pos, len(data) - 1)
        data[i] ^= draw(st.integers(1, 255))
    elif action == "set" and data:
        i = min(pos, len(data) - 1)
        data[i] = draw(st.sampled_from(INTERESTING_BYTES) | st.integers(0, 255))
    elif action == "insert":
        data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
    elif action == "delete":
        del data[pos : pos + draw(st.integers(1, 8))]
    elif action == "truncate":
        del data[pos:]
    elif action == "splice" and others:
        other = draw(st.sampled_from(others))
        data[pos:] = other[draw(st.integers(0, len(other))) :]
    elif action == "nest":
        data[pos:pos] = b"\x91" * draw(st.integers(1, NEST_DEPTH_MAX))
    return bytes(data)


@st.composite
def _mutated(draw: st.DrawFn, seeds: Sequence[bytes], tags: Sequence[str], rounds_max: int) -> bytes:
    data = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(1, rounds_max))):
        mutation = _field_mutation(data, tags) if draw(st.booleans()) else _byte_mutation(data, seeds)
        data = draw(mutation)
    return data


def mutated(
    seeds: Sequence[bytes], tags: Sequence[str] = (), rounds_max: int = 3
) -> st.SearchStrategy[bytes]:
    """Seeds changed by 1..`rounds_max` structure-aware (msgpack field) or byte-level mutations.
    `tags`: values of the `t` tag field to swap in (messages of another type or family)."""
    if not seeds:
        raise ValueError("mutated() needs at least one seed")
    return _mutated(list(seeds), list(tags), rounds_max)

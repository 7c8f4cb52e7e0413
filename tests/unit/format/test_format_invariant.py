"""`invariant()` raises InvariantViolation, and keeps doing so under `python -O`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfabric.format import InvariantViolation, invariant, unreachable


def test_invariant_passes_and_raises_with_context() -> None:
    invariant(True, "fine")
    invariant(1, "truthy is fine")
    with pytest.raises(InvariantViolation, match=r"^slot freed twice slot=3 gen=7$"):
        invariant(False, "slot freed twice", slot=3, gen=7)
    with pytest.raises(InvariantViolation, match=r"^empty$"):
        invariant([], "empty")


def test_invariant_violation_is_an_assertion_error_not_an_operating_error() -> None:
    from kvfabric.format import KvfError

    assert issubclass(InvariantViolation, AssertionError)
    assert not issubclass(InvariantViolation, KvfError)


def test_unreachable_always_raises() -> None:
    with pytest.raises(InvariantViolation, match="bad state state='x'"):
        unreachable("bad state", state="x")


_OPTIMIZED = """
import sys
assert not __debug__, "this child must run with -O"
assert False, "stripped under -O"  # would raise without -O
from kvfabric.format.invariant import InvariantViolation, invariant
try:
    invariant(False, "still checked", n=1)
except InvariantViolation as e:
    print("raised:", e)
    sys.exit(0)
sys.exit(3)
"""


def test_invariant_survives_python_dash_o() -> None:
    proc = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMIZED], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "raised: still checked n=1"

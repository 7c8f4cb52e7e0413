"""The chaos runner end to end on one drill, and the proof that its wrong-bytes checker can fail:
with the client's test switch that skips checksum verification, the corrupted-byte drill makes
the workload consume a wrong chunk and the drill fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.tools.toolkit import load_tool

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def test_corrupted_byte_drill_passes_and_its_checker_fails_without_verification() -> None:
    runner = load_tool("chaos")
    drill = REPO / "tests" / "drills" / "corrupted-byte.toml"
    verified = runner.run_drill(drill)
    assert verified["passed"], verified["violations"]
    assert verified["wrong_chunks"] == 0
    assert any(op["cause"] == "checksum" for op in verified["history"])  # the fault really landed
    unverified = runner.run_drill(drill, verify=False)
    assert not unverified["passed"]
    assert unverified["wrong_chunks"] > 0 and unverified["violations"]["wrong_bytes"]

"""The leadership_budget chaos checker (issue 27, nats-node-kill): shard leader leases lost during
a drill (counted from the directory logs by tools/chaos.py) stay within the drill's budget."""

from __future__ import annotations

import json
from pathlib import Path

from tests.unit.tools.toolkit import load_tool

c = load_tool("chaos_checks")
chaos = load_tool("chaos")


def test_leases_lost_over_the_budget_fail_and_no_budget_means_no_check() -> None:
    assert c.check_leadership_budget(0, 0) == []
    problems = c.check_leadership_budget(11, 0)
    assert problems and "11 shard leader lease(s) lost" in problems[0]
    assert c.check_leadership_budget(57, None) == []


def test_log_events_are_counted_over_every_log_rotated_ones_too(tmp_path: Path) -> None:
    def line(event: str, **fields: object) -> str:
        return json.dumps({"event": event, "level": "warning", **fields})

    (tmp_path / "directory.log").write_text(
        "\n".join(
            [
                line("leadership_lost", shard=1, reason="lease_expired"),
                line("leadership_lost", shard=3, reason="handover"),
                line("leadership_won", shard=1),
                "not json",
                "{broken",
            ]
        )
        + "\n"
    )
    (tmp_path / "directory-2.log.1").write_text(
        line("leadership_lost", shard=2)
        + "\n"
        + line("stop_requested", reason="leadership_lost:lease_expired")
        + "\n"
    )
    (tmp_path / "nats.log").write_text(
        "[1] 21:26:07.201359 [ERR] JetStream stream '$G > KV_KVF_DIRECTORY_LEADERS' critical write "
        "error: write .../1.blk: no space left on device\n"
        "[1] 21:26:07.201300 [ERR] Filestore [KV_KVF_DIRECTORY_LEADERS] Critical write error: ...\n"
    )
    counts = chaos.count_log_events(tmp_path)
    assert counts["nats_write_error:KV_KVF_DIRECTORY_LEADERS"] == 1  # one per stream, not per store line
    assert counts["leadership_lost"] == 2 and counts["leadership_handover"] == 1
    assert counts["events_stream_recreated"] == 0
    assert chaos.count_log_events(tmp_path / "missing")["leadership_lost"] == 0

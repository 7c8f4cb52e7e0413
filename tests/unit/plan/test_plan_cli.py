"""`kvplan` on the study guide's design example, text and `--json`."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvfabric.plan.cli import app, fmt_bytes, fmt_rate

SEED = [
    "--preset", "llama3-8b", "--prefixes", "32768", "--prefix-tokens", "8192",
    "--request-rate", "200", "--remote-share", "0.75", "--write-share", "0.25",
    "--hot-prefix-share", "0.1", "--hot-read-share", "0.5",
    "--hosts", "128", "--dram-gib", "512", "--usable", "0.8", "--nic-gbps", "400",
    "--domains", "8", "--replicas", "2", "--expand-hosts", "32",
]  # fmt: skip

GiB = 2**30
TiB = 2**40


def test_formatting() -> None:
    assert fmt_bytes(64 * TiB) == "64.00 TiB"
    assert fmt_bytes(57) == "57 B"
    assert fmt_rate(150 * GiB) == "150.00 GiB/s (1,288.5 Gbit/s)"


def test_seed_example_text() -> None:
    result = CliRunner().invoke(app, SEED)
    assert result.exit_code == 1, result.output  # 1 = does not fit
    out = result.output
    for expected in (
        "128.00 KiB",
        "1.00 GiB / 1.00 GiB",
        "32.00 TiB / 64.00 TiB",
        "51.20 TiB / 125.0%",
        "150.00 GiB/s (1,288.5 Gbit/s)",
        "112 / 44.80 TiB",
        "DOES NOT FIT: binding constraint dram_after_domain_loss",
        "needs 160 hosts, 183 to survive losing one of 8 failure domains",
    ):
        assert expected in out, expected


def test_seed_example_json() -> None:
    result = CliRunner().invoke(app, [*SEED, "--json"])
    assert result.exit_code == 1, result.output
    plan = json.loads(result.output)
    assert plan["capacity"]["logical_bytes"] == 32 * TiB
    assert plan["capacity"]["replicated_bytes"] == 64 * TiB
    assert plan["capacity"]["fits"] is False
    assert plan["traffic"]["read_bytes_per_s"] == 150 * GiB
    assert plan["traffic"]["write_bytes_per_s"] == 100 * GiB  # 50 new prefixes/s x 1 GiB x 2
    assert plan["domain_loss"]["lost_replica_bytes"] == 8 * TiB
    assert plan["expansion"]["moved_bytes"] == 64 * TiB * 32 / 160
    assert plan["verdict"]["hosts_needed"] == 160
    assert plan["verdict"]["hosts_needed_domain_loss"] == 183
    assert plan["inputs"]["model"]["name"] == "llama3-8b"


def test_fitting_cluster_and_raw_flags() -> None:
    args = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--hosts", "183", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["verdict"]["fits"] is True
    mla = ["--kv-lora-rank", "512", "--qk-rope-head-dim", "64", "--layers", "60", "--json"]
    result = CliRunner().invoke(app, mla)
    assert json.loads(result.output)["sizes"]["kv_bytes_per_token"] == 69_120


def test_bad_input_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["--preset", "nope"])
    assert result.exit_code == 2
    result = CliRunner().invoke(app, ["--kv-bytes-per-token", "131072", "--domains", "500"])
    assert result.exit_code == 2

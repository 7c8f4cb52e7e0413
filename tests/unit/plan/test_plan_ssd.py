"""kvplan's SSD tier (issue 23): capacity, the SSD's share of remote reads, demotion writes and
their write amplification, disk bandwidth constraints."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvfabric.plan.cli import app
from kvfabric.plan.formulas import dram_read_share, drive_writes_per_day
from kvfabric.plan.model import PRESETS, Cluster, Layout, Workload
from kvfabric.plan.plan import Plan, build_plan

GiB = 2**30
TiB = 2**40
SEED_WORK = Workload(
    prefixes=32768,
    prefix_tokens=8192,
    request_rate=200,
    remote_share=0.75,
    write_share=0.25,
    hot_prefix_share=0.1,
    hot_read_share=0.5,
)


def _plan(work: Workload = SEED_WORK, **cluster: float) -> Plan:
    base: dict[str, float] = {"hosts": 128, "dram_gib": 512, "usable_fraction": 0.8, "domains": 8}
    return build_plan(PRESETS["llama3-8b"], Layout(chunk_tokens=256), work, Cluster(**{**base, **cluster}))  # type: ignore[arg-type]


def test_dram_read_share_places_the_hottest_bytes_in_dram() -> None:
    assert dram_read_share(0.3, 1.0, 1.0) == pytest.approx(0.3)  # uniform reads: DRAM's byte share
    assert dram_read_share(0.8, 0.1, 0.5) == pytest.approx(0.5 + 0.5 * 0.7 / 0.9)  # hot set in DRAM
    assert dram_read_share(0.05, 0.1, 0.5) == pytest.approx(0.25)  # half the hot set in DRAM
    assert dram_read_share(1.0, 0.1, 0.5) == 1.0 and dram_read_share(2.0, 0.5, 0.5) == 1.0
    assert drive_writes_per_day(1000 / 86_400, 1000) == pytest.approx(1.0)
    assert drive_writes_per_day(1.0, 0) == 0.0


def test_the_seed_example_fits_with_an_ssd_tier_under_dram() -> None:
    plan = _plan(ssd_gib=3840, ssd_read_gib_s=6, ssd_write_gib_s=3)
    ssd = plan.ssd
    assert ssd.enabled and ssd.fits and not plan.capacity.fits  # DRAM alone holds 51.2 of 64 TiB
    assert ssd.capacity_bytes == pytest.approx(128 * 3840 * GiB * 0.9)
    assert ssd.dram_resident_bytes == pytest.approx(51.2 * TiB)
    assert ssd.ssd_resident_bytes == pytest.approx(12.8 * TiB)
    assert ssd.read_share == pytest.approx(1 / 9)  # 1 - (0.5 + 0.5 * 0.7 / 0.9)
    assert ssd.read_bytes_per_s == pytest.approx(150 * GiB / 9)
    assert ssd.per_host_read_bytes_per_s == pytest.approx(150 * GiB / 9 / 128)  # the hot set is in DRAM
    assert ssd.demotion_bytes_per_s == 100 * GiB  # every byte written into a full DRAM pushes one out
    assert ssd.write_amplification == pytest.approx(6.0)
    assert ssd.drive_writes_per_day == pytest.approx(100 * GiB / 128 * 86_400 / (3840 * GiB))
    assert ssd.write_utilization == pytest.approx(100 / 128 / 3)
    v = plan.verdict
    names = [c.name for c in v.constraints]
    assert names[:2] == ["dram_ssd", "dram_ssd_after_domain_loss"]
    assert "ssd_read_bandwidth" in names and "ssd_write_bandwidth" in names
    assert v.fits and v.binding == "ssd_write_bandwidth"
    assert plan.domain_loss.repairable and plan.domain_loss.unrepaired_bytes == 0


def test_disk_bandwidth_can_bind_and_sets_the_hosts_needed() -> None:
    plan = _plan(ssd_gib=3840, ssd_write_gib_s=0.5)
    (write,) = [c for c in plan.verdict.constraints if c.name == "ssd_write_bandwidth"]
    assert write.utilization == pytest.approx(100 / 128 / 0.5) and not write.ok
    assert write.hosts_needed == 200  # 100 GiB/s of demotions at 0.5 GiB/s a host
    assert not plan.verdict.fits and plan.verdict.hosts_needed == 200
    assert "ssd_read_bandwidth" not in [c.name for c in plan.verdict.constraints]  # not given


def test_no_spill_no_demotion_and_no_ssd_means_the_dram_plan() -> None:
    roomy = _plan(hosts=183, ssd_gib=1000)
    assert roomy.ssd.ssd_resident_bytes == 0 and roomy.ssd.demotion_bytes_per_s == 0
    assert roomy.ssd.read_share == 0 and roomy.ssd.write_amplification == 0
    none = _plan()
    assert not none.ssd.enabled and none.ssd.read_share == 0 and none.ssd.demotion_bytes_per_s == 0
    assert [c.name for c in none.verdict.constraints][:2] == ["dram", "dram_after_domain_loss"]
    assert (none.verdict.hosts_needed, none.verdict.hosts_needed_domain_loss) == (160, 183)
    dropped = _plan(ssd_gib=3840, demote_share=0.25)
    assert dropped.ssd.demotion_bytes_per_s == 25 * GiB


def test_a_given_ssd_read_share_overrides_the_derived_one() -> None:
    work = Workload(
        prefixes=32768, prefix_tokens=8192, request_rate=200, remote_share=0.75, ssd_read_share=0.5
    )
    plan = _plan(work, ssd_gib=3840)
    assert plan.ssd.read_bytes_per_s == 75 * GiB
    with pytest.raises(ValueError, match="ssd_read_share"):
        Workload(prefixes=1, prefix_tokens=1, request_rate=1, ssd_read_share=1.5)
    with pytest.raises(ValueError, match="ssd_gib"):
        Cluster(hosts=1, dram_gib=1, domains=1, ssd_gib=-1)
    with pytest.raises(ValueError, match="demote_share"):
        Cluster(hosts=1, dram_gib=1, domains=1, demote_share=2)


def test_cli_prints_the_ssd_tier_and_its_json() -> None:
    args = [
        "--preset", "llama3-8b", "--request-rate", "200", "--remote-share", "0.75",
        "--write-share", "0.25", "--hot-prefix-share", "0.1", "--hot-read-share", "0.5",
        "--hosts", "128", "--dram-gib", "512", "--domains", "8",
        "--ssd-gib", "3840", "--ssd-read-gib-s", "6", "--ssd-write-gib-s", "3",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for expected in ("SSD tier", "51.20 TiB / 12.80 TiB", "88.9% / 11.1%", "6.00 / 17.58", "dram_ssd"):
        assert expected in result.output, expected
    result = CliRunner().invoke(app, [*args, "--json"])
    plan = json.loads(result.output)
    assert plan["ssd"]["demotion_bytes_per_s"] == 100 * GiB
    assert plan["inputs"]["cluster"]["ssd_gib"] == 3840
    assert CliRunner().invoke(app, [*args, "--ssd-usable", "0"]).exit_code == 2

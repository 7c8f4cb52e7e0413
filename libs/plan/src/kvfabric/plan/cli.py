"""`kvplan`: capacity, object, metadata and bandwidth plan for a kvfabric cluster.

Example (the study guide's design problem, docs/capacity-planning.md):

    kvplan --preset llama3-8b --prefixes 32768 --prefix-tokens 8192 --request-rate 200 \
        --remote-share 0.75 --hosts 128 --dram-gib 512 --usable 0.8 --nic-gbps 400 --domains 8
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from kvfabric.plan.model import PRESETS, Cluster, Layout, ModelSpec, Workload, model_from_config
from kvfabric.plan.plan import Plan, build_plan

__all__ = ["app", "fmt_bytes", "fmt_rate", "main", "render"]

app = typer.Typer(add_completion=False, help=__doc__.split("\n")[0] if __doc__ else None)

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: float) -> str:
    """Binary units: KiB = 2**10 B, GiB = 2**30 B, TiB = 2**40 B."""
    if math.isinf(n):
        return "inf"
    i = 0
    while abs(n) >= 1024 and i < len(_UNITS) - 1:
        n /= 1024
        i += 1
    return f"{n:,.0f} B" if i == 0 else f"{n:,.2f} {_UNITS[i]}"


def fmt_rate(n: float) -> str:
    """Bytes/s in binary units plus Gbit/s (1e9 bit/s)."""
    return f"{fmt_bytes(n)}/s ({n * 8 / 1e9:,.1f} Gbit/s)"


def fmt_seconds(s: float) -> str:
    if math.isinf(s):
        return "never"
    return f"{s:,.1f} s" if s < 120 else f"{s / 60:,.1f} min"


def _yes(ok: bool) -> str:
    return "[green]yes[/]" if ok else "[bold red]NO[/]"


def _table(title: str) -> Table:
    t = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 2), min_width=100)
    t.add_column("quantity")
    t.add_column("value", justify="right")
    return t


def render(plan: Plan, console: Console) -> None:
    """Print the plan as rich tables."""
    m, lay, w, c = plan.inputs.model, plan.inputs.layout, plan.inputs.workload, plan.inputs.cluster
    s, md, cap, t = plan.sizes, plan.metadata, plan.capacity, plan.traffic
    loss, exp, v, ssd = plan.domain_loss, plan.expansion, plan.verdict, plan.ssd

    kind = "explicit bytes/token" if m.kv_bytes_per_token else ("MLA" if m.is_mla else "MHA/GQA")
    tab = _table(
        f"Objects — {m.name} ({kind}, {m.dtype}), tp={lay.tp} pp={lay.pp} "
        f"layer_groups={lay.layer_groups}, chunk={lay.chunk_tokens} tokens"
    )
    tab.add_row("KV per token", f"{fmt_bytes(s.kv_bytes_per_token)} (stored x{s.tp_duplication:g})")
    tab.add_row("KV per chunk / per object", f"{fmt_bytes(s.chunk_bytes)} / {fmt_bytes(s.object_bytes)}")
    tab.add_row("objects per chunk (tp x pp x groups)", f"{s.objects_per_chunk}")
    tab.add_row("chunks per prefix (mean / max)", f"{s.chunks_per_prefix} / {s.chunks_per_prefix_max}")
    tab.add_row(
        "KV per prefix (mean / max)", f"{fmt_bytes(s.prefix_bytes)} / {fmt_bytes(s.prefix_bytes_max)}"
    )
    tab.add_row(
        "chunk groups / objects / object replicas",
        f"{s.chunk_groups:,} / {s.objects:,} / {s.object_replicas:,}",
    )
    console.print(tab)

    tab = _table("Metadata")
    tab.add_row("key / chunk-group id", f"{md.key_bytes} B / {md.chunk_group_id_bytes} B")
    tab.add_row("all object keys", fmt_bytes(md.keys_bytes))
    tab.add_row("directory record per chunk group", f"{md.group_record_bytes} B")
    tab.add_row(
        "directory records / est. directory RAM",
        f"{fmt_bytes(md.directory_record_bytes)} / {fmt_bytes(md.directory_ram_bytes)}",
    )
    tab.add_row(
        "manifest per prefix (mean / max) / all",
        f"{fmt_bytes(md.manifest_bytes)} / {fmt_bytes(md.manifest_bytes_max)} / "
        f"{fmt_bytes(md.manifests_bytes)}",
    )
    tab.add_row(
        "lookups (chunk groups/s) / shards needed",
        f"{md.lookups_groups_per_s:,.0f} / {md.lookup_shards_needed}",
    )
    tab.add_row(
        "publishes (objects/s) / shards needed",
        f"{md.publishes_objects_per_s:,.0f} / {md.publish_shards_needed}",
    )
    console.print(tab)

    tab = _table(
        f"Capacity — {c.hosts} hosts x {c.dram_gib:g} GiB at {c.usable_fraction:.0%} usable, "
        f"{c.replicas} replicas, {c.domains} failure domains"
    )
    tab.add_row("logical / replicated", f"{fmt_bytes(cap.logical_bytes)} / {fmt_bytes(cap.replicated_bytes)}")
    tab.add_row("usable DRAM / utilization", f"{fmt_bytes(cap.usable_bytes)} / {cap.utilization:.1%}")
    tab.add_row(
        "per host: stored / usable",
        f"{fmt_bytes(cap.per_host_bytes)} / {fmt_bytes(cap.per_host_usable_bytes)}",
    )
    tab.add_row(
        f"per domain ({cap.hosts_per_domain} hosts): stored / usable",
        f"{fmt_bytes(cap.per_domain_bytes)} / {fmt_bytes(cap.per_domain_usable_bytes)}",
    )
    tab.add_row("replicated set fits", _yes(cap.fits))
    console.print(tab)

    tab = _table(
        f"Traffic — {w.request_rate:g} req/s, {w.remote_share:.0%} remote loads, "
        f"{w.write_share:.0%} writes, NIC {c.nic_gbps:g} Gbit/s at {c.nic_usable_fraction:.0%}"
    )
    tab.add_row(
        "reads / writes (all replicas), cluster",
        f"{fmt_rate(t.read_bytes_per_s)} / {fmt_rate(t.write_bytes_per_s)}",
    )
    tab.add_row(
        "per host reads / writes (mean)",
        f"{fmt_rate(t.per_host_read_bytes_per_s)} / {fmt_rate(t.per_host_write_bytes_per_s)}",
    )
    tab.add_row("hot-spot factor", f"{t.hotspot_factor:.2f}")
    tab.add_row(
        "peak host egress / usable NIC",
        f"{fmt_rate(t.peak_host_egress_bytes_per_s)} / {fmt_rate(t.nic_usable_bytes_per_s)}",
    )
    tab.add_row("repair budget per host", fmt_rate(t.repair_budget_per_host_bytes_per_s))
    tab.add_row("NIC utilization / fits", f"{t.nic_utilization:.1%} / {_yes(t.fits)}")
    console.print(tab)

    if ssd.enabled:
        tab = _table(
            f"SSD tier — {c.ssd_gib:g} GiB per host at {c.ssd_usable_fraction:.0%} usable, "
            f"{c.demote_share:.0%} of DRAM victims demoted"
        )
        tab.add_row(
            "SSD capacity / per host",
            f"{fmt_bytes(ssd.capacity_bytes)} / {fmt_bytes(ssd.per_host_capacity_bytes)}",
        )
        tab.add_row(
            "in DRAM / on SSD / SSD used",
            f"{fmt_bytes(ssd.dram_resident_bytes)} / {fmt_bytes(ssd.ssd_resident_bytes)}"
            f" / {ssd.utilization:.1%}",
        )
        tab.add_row("replicated set fits in DRAM + SSD", _yes(ssd.fits))
        tab.add_row(
            "remote reads served by DRAM / SSD",
            f"{ssd.dram_read_share:.1%} / {ssd.read_share:.1%}"
            + (" (given)" if w.ssd_read_share is not None else ""),
        )
        tab.add_row(
            "SSD reads: cluster / peak host",
            f"{fmt_rate(ssd.read_bytes_per_s)} / {fmt_rate(ssd.per_host_read_bytes_per_s)}",
        )
        tab.add_row(
            "demotions: cluster / host",
            f"{fmt_rate(ssd.demotion_bytes_per_s)} / {fmt_rate(ssd.per_host_demotion_bytes_per_s)}",
        )
        tab.add_row(
            "write amplification / drive writes per day",
            f"{ssd.write_amplification:.2f} / {ssd.drive_writes_per_day:.2f}",
        )
        if c.ssd_read_gib_s or c.ssd_write_gib_s:
            tab.add_row(
                "disk read / write utilization",
                f"{ssd.read_utilization:.1%} / {ssd.write_utilization:.1%} {_yes(ssd.bandwidth_fits)}",
            )
        console.print(tab)

    store = "DRAM + SSD" if ssd.enabled else "DRAM"
    tab = _table(f"One failure domain lost ({loss.hosts_lost} hosts)")
    tab.add_row(
        f"hosts left / usable {store} left", f"{loss.hosts_left} / {fmt_bytes(loss.usable_bytes_left)}"
    )
    tab.add_row("utilization after", f"{loss.utilization_after:.1%}")
    tab.add_row("replica bytes lost", fmt_bytes(loss.lost_replica_bytes))
    tab.add_row(
        "repair bandwidth / time to re-copy",
        f"{fmt_rate(loss.repair_bytes_per_s)} / {fmt_seconds(loss.repair_seconds)}",
    )
    tab.add_row("left with fewer replicas (no room)", fmt_bytes(loss.unrepaired_bytes))
    tab.add_row(
        "peak host egress (reads + repair) / NIC util",
        f"{fmt_rate(loss.peak_host_egress_bytes_per_s)} / {loss.nic_utilization_after:.1%}",
    )
    tab.add_row("fully repairable", _yes(loss.repairable))
    console.print(tab)

    if exp.hosts_added:
        tab = _table(f"Expand by {exp.hosts_added} hosts (to {exp.hosts_after})")
        tab.add_row(
            f"usable {store} after / utilization",
            f"{fmt_bytes(exp.usable_bytes_after)} / {exp.utilization_after:.1%}",
        )
        tab.add_row(
            "data moved / time (new hosts' repair budget)",
            f"{fmt_bytes(exp.moved_bytes)} / {fmt_seconds(exp.move_seconds)}",
        )
        tab.add_row("replicated set fits after", _yes(exp.fits))
        console.print(tab)

    tab = Table(title="Constraints", title_justify="left", box=None, padding=(0, 2), min_width=100)
    for col in ("constraint", "utilization", "ok", "hosts needed"):
        tab.add_column(col, justify="left" if col == "constraint" else "right")
    for con in v.constraints:
        tab.add_row(con.name, f"{con.utilization:.1%}", _yes(con.ok), f"{con.hosts_needed}")
    console.print(tab)
    console.print(("[bold green]" if v.fits else "[bold red]") + v.summary + "[/]", soft_wrap=True)


@app.command()
def plan(
    preset: Annotated[str | None, typer.Option(help=f"model preset: {', '.join(PRESETS)}")] = None,
    config: Annotated[Path | None, typer.Option(help="transformers config.json", exists=True)] = None,
    layers: Annotated[int, typer.Option(help="layers")] = 0,
    kv_heads: Annotated[int, typer.Option(help="KV heads (GQA)")] = 0,
    head_dim: Annotated[int, typer.Option(help="head dim")] = 0,
    kv_lora_rank: Annotated[int, typer.Option(help="MLA latent rank (0: not MLA)")] = 0,
    qk_rope_head_dim: Annotated[int, typer.Option(help="MLA decoupled RoPE key dim")] = 0,
    dtype: Annotated[str | None, typer.Option(help="KV dtype: bf16, fp16, fp8, fp32, int8, int4")] = None,
    kv_bytes_per_token: Annotated[float, typer.Option(help="KV bytes per token (overrides the model)")] = 0.0,
    tp: Annotated[int, typer.Option(help="tensor-parallel ranks")] = 1,
    pp: Annotated[int, typer.Option(help="pipeline stages")] = 1,
    layer_groups: Annotated[int, typer.Option(help="layer groups per object")] = 1,
    chunk_tokens: Annotated[int, typer.Option(help="tokens per chunk")] = 256,
    tp_dedup: Annotated[bool, typer.Option(help="store TP-replicated KV once")] = False,
    prefixes: Annotated[int, typer.Option(help="retained prefixes")] = 32768,
    prefix_tokens: Annotated[int, typer.Option(help="prefix length (mean)")] = 8192,
    prefix_tokens_max: Annotated[int, typer.Option(help="longest prefix (0: fixed length)")] = 0,
    request_rate: Annotated[float, typer.Option(help="requests/s")] = 200.0,
    remote_share: Annotated[float, typer.Option(help="share of requests loading the prefix remotely")] = 0.75,
    write_share: Annotated[float, typer.Option(help="share of requests publishing a new prefix")] = 0.0,
    hot_prefix_share: Annotated[float, typer.Option(help="share of prefixes in the hot set")] = 1.0,
    hot_read_share: Annotated[float, typer.Option(help="share of reads going to the hot set")] = 1.0,
    hotspot_factor: Annotated[float, typer.Option(help="per-host peak/mean (0: derive)")] = 0.0,
    hosts: Annotated[int, typer.Option(help="storage hosts")] = 128,
    dram_gib: Annotated[float, typer.Option(help="DRAM per host, GiB")] = 512.0,
    usable: Annotated[float, typer.Option(help="usable DRAM fraction")] = 0.8,
    nic_gbps: Annotated[float, typer.Option(help="NIC per host, Gbit/s")] = 400.0,
    nic_usable: Annotated[float, typer.Option(help="usable NIC fraction")] = 0.8,
    domains: Annotated[int, typer.Option(help="failure domains (racks)")] = 8,
    replicas: Annotated[int, typer.Option(help="replicas per object")] = 2,
    repair_share: Annotated[float, typer.Option(help="NIC share per host for repair/rebalance")] = 0.25,
    expand_hosts: Annotated[int, typer.Option(help="hosts added in the expansion scenario")] = 0,
    directory_shards: Annotated[int, typer.Option(help="directory shards")] = 1,
    ssd_gib: Annotated[float, typer.Option(help="SSD tier per host, GiB (0: none)")] = 0.0,
    ssd_usable: Annotated[float, typer.Option(help="usable SSD fraction")] = 0.9,
    ssd_read_gib_s: Annotated[
        float, typer.Option(help="SSD read bandwidth per host, GiB/s (0: unchecked)")
    ] = 0.0,
    ssd_write_gib_s: Annotated[
        float, typer.Option(help="SSD write bandwidth per host, GiB/s (0: unchecked)")
    ] = 0.0,
    demote_share: Annotated[float, typer.Option(help="share of DRAM victims demoted to the SSD")] = 1.0,
    ssd_read_share: Annotated[
        float | None, typer.Option(help="share of remote-load bytes read from the SSD (default: derived)")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Plan memory, objects, metadata and network for a kvfabric cluster."""
    try:
        if config is not None:
            model = model_from_config(config, dtype=dtype)
        elif preset is not None:
            if preset not in PRESETS:
                raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
            model = PRESETS[preset]
            if dtype is not None:
                model = msgspec.structs.replace(model, dtype=dtype)
        else:
            model = ModelSpec(
                layers=layers,
                kv_heads=kv_heads,
                head_dim=head_dim,
                dtype=dtype or "bf16",
                kv_lora_rank=kv_lora_rank,
                qk_rope_head_dim=qk_rope_head_dim,
                kv_bytes_per_token=kv_bytes_per_token,
            )
        if kv_bytes_per_token and (config is not None or preset is not None):
            model = msgspec.structs.replace(model, kv_bytes_per_token=kv_bytes_per_token)
        result = build_plan(
            model,
            Layout(tp=tp, pp=pp, layer_groups=layer_groups, chunk_tokens=chunk_tokens, tp_dedup=tp_dedup),
            Workload(
                prefixes=prefixes,
                prefix_tokens=prefix_tokens,
                prefix_tokens_max=prefix_tokens_max,
                request_rate=request_rate,
                remote_share=remote_share,
                write_share=write_share,
                hot_prefix_share=hot_prefix_share,
                hot_read_share=hot_read_share,
                hotspot_factor=hotspot_factor,
                ssd_read_share=ssd_read_share,
            ),
            Cluster(
                hosts=hosts,
                dram_gib=dram_gib,
                usable_fraction=usable,
                nic_gbps=nic_gbps,
                nic_usable_fraction=nic_usable,
                domains=domains,
                replicas=replicas,
                repair_share=repair_share,
                expand_hosts=expand_hosts,
                directory_shards=directory_shards,
                ssd_gib=ssd_gib,
                ssd_usable_fraction=ssd_usable,
                ssd_read_gib_s=ssd_read_gib_s,
                ssd_write_gib_s=ssd_write_gib_s,
                demote_share=demote_share,
            ),
        )
    except (ValueError, KeyError) as e:
        raise typer.BadParameter(str(e)) from None
    if json_out:
        typer.echo(msgspec.json.format(msgspec.json.encode(result).decode(), indent=2))
    else:
        render(result, Console(width=110, highlight=False))
    raise typer.Exit(0 if result.verdict.fits else 1)


def main() -> None:
    app()

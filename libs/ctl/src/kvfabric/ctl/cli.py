"""`kvctl`: typer commands. Each parses its input (bad input: exit 2), runs one async query with
`asyncio.run` and renders a table or, with `--json`, a JSON document. A `KvfError` prints one
line `<code>: <message>` on stderr and exits 1."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Annotated, Any, Final, TypeVar

import typer

from kvfabric.ctl import auth, render
from kvfabric.ctl import queries as q
from kvfabric.ctl.keys import decode_key, group_id_of, group_of, key_fields
from kvfabric.format.errors import BadRequest, KvfError
from kvfabric.format.ids import DomainDigest
from kvfabric.proto import directory as m
from kvfabric.proto.subjects import check_segment_id

__all__ = ["EXIT_BAD_INPUT", "EXIT_ERROR", "app", "main"]

EXIT_ERROR: Final = 1
EXIT_BAD_INPUT: Final = 2
DEFAULT_NATS_URL: Final = "nats://127.0.0.1:4222"

T = TypeVar("T")

app = typer.Typer(name="kvctl", help="Inspect and operate a kvfabric cluster.", no_args_is_help=True)
key_app = typer.Typer(help="KV keys and chunk group ids.", no_args_is_help=True)
objects_app = typer.Typer(help="Published chunk groups.", no_args_is_help=True)
manifest_app = typer.Typer(help="Chunk group manifests.", no_args_is_help=True)
leases_app = typer.Typer(help="Leases and pins held at the directory.", no_args_is_help=True)
pins_app = typer.Typer(help="Pin chunk groups against eviction.", no_args_is_help=True)
segment_app = typer.Typer(help="Segment operations.", no_args_is_help=True)
events_app = typer.Typer(help="The directory's JetStream event stream.", no_args_is_help=True)
eviction_app = typer.Typer(
    help="The eviction policy: its state, and why it keeps or drops a group.", no_args_is_help=True
)
tenants_app = typer.Typer(help="Tenants (share domains): usage against quotas.", no_args_is_help=True)
auth_app = typer.Typer(help="NATS users, permissions, share domains and TLS.", no_args_is_help=True)
for _name, _sub in (
    ("key", key_app),
    ("objects", objects_app),
    ("manifest", manifest_app),
    ("leases", leases_app),
    ("pins", pins_app),
    ("segment", segment_app),
    ("events", events_app),
    ("tenants", tenants_app),
    ("eviction", eviction_app),
    ("auth", auth_app),
):
    app.add_typer(_sub, name=_name)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
UrlOpt = Annotated[str, typer.Option("--nats-url", envvar="KVF_NATS_URL", help="NATS server URL.")]
TimeoutOpt = Annotated[float, typer.Option("--timeout-s", min=0.05, help="Per-request timeout, seconds.")]


class Env:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s


def _fail(code: str, message: str, exit_code: int) -> typer.Exit:
    render.error_line(code, message)
    return typer.Exit(exit_code)


def _parse(fn: Callable[[], T]) -> T:
    """Local parsing of user input: `BadRequest` → exit 2."""
    try:
        return fn()
    except KvfError as exc:
        raise _fail(exc.code, exc.message, EXIT_BAD_INPUT) from None


def _run(env: Env, body: Callable[[q.NatsClient], Coroutine[Any, Any, T]]) -> T:
    async def go() -> T:
        async with q.connect(env.url, env.timeout_s) as nc:
            return await body(nc)

    try:
        return asyncio.run(go())
    except KvfError as exc:
        raise _fail(exc.code, exc.message, EXIT_ERROR) from None


# ---- status ----------------------------------------------------------------------------------


@app.command()
def status(json: JsonOpt = False, nats_url: UrlOpt = DEFAULT_NATS_URL, timeout_s: TimeoutOpt = 5.0) -> None:
    """Segments known to the directory and the services answering $SRV.PING."""
    env = Env(nats_url, timeout_s)

    async def body(nc: q.NatsClient) -> tuple[m.SegmentList, list[q.ServiceInstance]]:
        reply = await q.list_segments(await q.router(nc), env.timeout_s)
        return reply, await q.ping_services(nc)

    segments, services = _run(env, body)
    if json:
        render.emit_json(
            {
                "epoch": segments.epoch,
                "segments": [render.segment_doc(s) for s in segments.segments],
                "services": [q.jsonable(s) for s in services],
            }
        )
    else:
        render.print_status(segments.segments, services, segments.epoch)


# ---- keys ------------------------------------------------------------------------------------


@key_app.command("decode")
def key_decode(
    key: Annotated[str, typer.Argument(help="Key or chunk group: kvf1:..., kvg1:..., or hex.")],
    json: JsonOpt = False,
) -> None:
    """Readable form and fields of a key or chunk group id (no NATS)."""
    fields = key_fields(_parse(lambda: decode_key(key)))
    if json:
        render.emit_json(fields)
    else:
        render.print_fields(fields)


# ---- objects and manifests -------------------------------------------------------------------


@objects_app.command("ls")
def objects_ls(
    domain: Annotated[str, typer.Option("--domain", help="Share domain digest (16 bytes, hex).")] = "",
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many groups.")] = 100,
    json: JsonOpt = False,
    nats_url: UrlOpt = DEFAULT_NATS_URL,
    timeout_s: TimeoutOpt = 5.0,
) -> None:
    """Published chunk groups (read-only: grants no lease)."""
    env = Env(nats_url, timeout_s)

    def digest() -> DomainDigest:
        try:
            raw = DomainDigest(bytes.fromhex(domain))
        except ValueError:
            raise BadRequest(f"--domain is not hex: {domain[:40]!r}") from None
        if raw and len(raw) != 16:
            raise BadRequest(f"--domain must be 16 bytes of hex, got {len(raw)}")
        return raw

    domain_digest = _parse(digest)

    async def body(nc: q.NatsClient) -> list[m.GroupSummary]:
        return await q.list_all_groups(await q.router(nc), domain_digest, limit, env.timeout_s)

    groups = _run(env, body)
    if json:
        render.emit_json({"groups": [render.group_doc(g) for g in groups]})
    else:
        render.print_groups(groups)


@manifest_app.command("show")
def manifest_show(
    group: Annotated[str, typer.Argument(help="Key or chunk group (kvf1:/kvg1: or hex), or chain hash hex.")],
    json: JsonOpt = False,
    nats_url: UrlOpt = DEFAULT_NATS_URL,
    timeout_s: TimeoutOpt = 5.0,
) -> None:
    """One chunk group's manifest: members, sizes, checksums, replicas (grants no lease)."""
    env = Env(nats_url, timeout_s)
    raw = _parse(lambda: group_of(group, allow_chain_hash=True))

    async def body(nc: q.NatsClient) -> m.GroupList:
        return await q.show_group(await q.router(nc), raw, env.timeout_s)

    reply = _run(env, body)
    if not reply.groups:
        raise _fail("not_found", "no such chunk group", EXIT_ERROR)
    if json:
        render.emit_json(render.group_doc(reply.groups[0]))
    else:
        render.print_manifest(reply.groups[0])


# ---- leases and pins -------------------------------------------------------------------------


def _list_leases(limit: int, nats_url: str, timeout_s: float, *, pins_only: bool, json: bool) -> None:
    env = Env(nats_url, timeout_s)

    async def body(nc: q.NatsClient) -> tuple[int, list[q.ShardLease]]:
        routed = await q.router(nc)
        listed = await q.list_leases(routed, limit, env.timeout_s, pins_only=pins_only)
        return q.newest_epoch(routed), listed

    epoch, leases = _run(env, body)
    if json:  # ids are per shard: each lease names its shard
        docs = [{**q.jsonable(x.lease), "shard": x.shard} for x in leases]
        render.emit_json({"epoch": epoch, "pins" if pins_only else "leases": docs})
    else:
        render.print_leases([x.lease for x in leases])


@leases_app.command("ls")
def leases_ls(
    limit: Annotated[int, typer.Option("--limit", min=1, max=m.LIST_LIMIT_MAX)] = 100,
    json: JsonOpt = False,
    nats_url: UrlOpt = DEFAULT_NATS_URL,
    timeout_s: TimeoutOpt = 5.0,
) -> None:
    """Leases and pins the directory holds."""
    _list_leases(limit, nats_url, timeout_s, pins_only=False, json=json)


@pins_app.command("ls")
def pins_ls(
    limit: Annotated[int, typer.Option("--limit", min=1, max=m.LIST_LIMIT_MAX)] = 100,
    json: JsonOpt = False,
    nats_url: UrlOpt = DEFAULT_NATS_URL,
    timeout_s: TimeoutOpt = 5.0,
) -> None:
    """Pins the directory holds (leases ls shows read leases too)."""
    _list_leases(limit, nats_url, timeout_s, pins_only=True, json=json)


@tenants_app.command("ls")
def tenants_ls(
    limit: Annotated[int, typer.Option("--limit", min=1, max=m.LIST_LIMIT_MAX)] = 100,
    json: JsonOpt = False,
    nats_url: UrlOpt = DEFAULT_NATS_URL,
    timeout_s: TimeoutOpt = 5.0,
) -> None:
    """Bytes and objects each tenant holds against its quota, its rate limit and refusals."""
    env = Env(nats_url, timeout_s)

    async def body(nc: q.NatsClient) -> m.TenantList:
        return await q.list_tenants(await q.router(nc), limit, env.timeout_s)

    reply = _run(env, body)
    if json:
        render.emit_json(
            {
                "epoch": reply.epoch,
                "default": q.jsonable(reply.default),
                "tenants": [q.jsonable(t) for t in reply.tenants],
            }
        )
    else:
        render.print_tenants(reply.tenants, reply.default)


@pins_app.command("add")
def pins_add(
    groups: Annotated[list[str], typer.Argument(help="Chunk groups or keys (kvg1:/kvf1: or hex).")],
    ttl_ms: Annotated[int, typer.Option("--ttl-ms", min=1, max=m.PIN_TTL_MS_MAX)] = 3_600_000,
    holder: Annotated[str, typer.Option("--holder", help="Holder id owning the pin.")] = "kvctl",
    json: JsonOpt = False,
    nats_url: UrlOpt = DEFAULT_NATS_URL,
    timeout_s: TimeoutOpt = 5.0,
) -> None:
    """Pin published chunk groups against eviction for --ttl-ms (one pin per directory shard
    the groups fall in: pin ids are per shard)."""
    env = Env(nats_url, timeout_s)
    raws = _parse(lambda: [group_id_of(g) for g in groups])

    async def body(nc: q.NatsClient) -> list[tuple[int, m.PinReply]]:
        return await q.pin(await q.router(nc), holder, raws, ttl_ms, env.timeout_s)

    pins = _run(env, body)
    if json:  # one pin as before (the first that pins something); each shard's under "shards"
        first_shard, first = next(((s, r) for s, r in pins if r.pin_id), pins[0])
        doc = {**q.jsonable(first), "shard": first_shard}
        if len(pins) > 1:
            doc["pinned_groups"] = sum(reply.pinned_groups for _, reply in pins)
            doc["shards"] = [{**q.jsonable(reply), "shard": shard} for shard, reply in pins]
        render.emit_json(doc)
    else:
        for _, reply in pins:
            render.print_pin(reply, added=True)


@pins_app.command("rm")
def pins_rm(
    pin_id: Annotated[int, typer.Argument(min=1)],
    holder: Annotated[str, typer.Option("--holder", help="Holder id owning the pin.")] = "kvctl",
    shard: Annotated[
        int | None,
        typer.Option("--shard", min=0, help="Directory shard holding the pin (default: the one listing it)."),
    ] = None,
    json: JsonOpt = False,
    nats_url: UrlOpt = DEFAULT_NATS_URL,
    timeout_s: TimeoutOpt = 5.0,
) -> None:
    """Remove a pin."""
    env = Env(nats_url, timeout_s)

    async def body(nc: q.NatsClient) -> m.PinReply:
        return await q.unpin(await q.router(nc), holder, pin_id, shard, env.timeout_s)

    reply = _run(env, body)
    if json:
        render.emit_json(q.jsonable(reply))
    else:
        render.print_pin(reply, added=False)


# ---- segments and events ---------------------------------------------------------------------


@segment_app.command("drain")
def segment_drain(
    segment_id: Annotated[str, typer.Argument(help="Segment id.")],
    undo: Annotated[bool, typer.Option("--undo", help="Accept writes again.")] = False,
    json: JsonOpt = False,
    nats_url: UrlOpt = DEFAULT_NATS_URL,
    timeout_s: TimeoutOpt = 5.0,
) -> None:
    """Make a segment refuse new writes (it keeps serving reads), or undo it."""
    env = Env(nats_url, timeout_s)

    def checked() -> str:
        try:
            return check_segment_id(segment_id)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    sid = _parse(checked)
    state = _run(env, lambda nc: q.drain_segment(nc, sid, not undo, env.timeout_s))
    if json:
        render.emit_json({"segment_id": sid, **q.jsonable(state)})
    else:
        render.print_drain(sid, state)


@events_app.command("tail")
def events_tail(
    n: Annotated[int, typer.Option("--n", "-n", min=1, max=10_000, help="How many of the last events.")] = 20,
    json: JsonOpt = False,
    nats_url: UrlOpt = DEFAULT_NATS_URL,
    timeout_s: TimeoutOpt = 5.0,
) -> None:
    """The last N directory events (SegmentUp, GroupPublished, ...)."""
    env = Env(nats_url, timeout_s)
    events = _run(env, lambda nc: q.tail_events(nc, n, env.timeout_s))
    if json:
        render.emit_json({"events": [q.jsonable(e) for e in events]})
    else:
        render.print_events(events)


# ---- eviction policy -------------------------------------------------------------------------


@eviction_app.command("status")
def eviction_status(
    json: JsonOpt = False, nats_url: UrlOpt = DEFAULT_NATS_URL, timeout_s: TimeoutOpt = 5.0
) -> None:
    """What the eviction policy tracks per pool (segment, disk tier) and tenant, and its counters."""
    env = Env(nats_url, timeout_s)
    status = _run(env, lambda nc: q.eviction_status(nc, env.timeout_s))
    if json:
        render.emit_json(q.jsonable(status))
    else:
        render.print_eviction_status(status)


@eviction_app.command("explain")
def eviction_explain(
    group: Annotated[str, typer.Argument(help="Key or chunk group: kvf1:..., kvg1:..., or hex.")],
    json: JsonOpt = False,
    nats_url: UrlOpt = DEFAULT_NATS_URL,
    timeout_s: TimeoutOpt = 5.0,
) -> None:
    """Why the eviction policy holds, held or dropped a chunk group: the features it ranks it by,
    its latest decisions with their reason codes (tracked, chosen as a victim and why, evicted,
    stays leased, demoted ...), and what the live admission filter says of it."""
    env = Env(nats_url, timeout_s)
    raw = _parse(lambda: group_id_of(group))
    reply = _run(env, lambda nc: q.eviction_explain(nc, raw, env.timeout_s))
    if json:
        render.emit_json({"group_id": raw.hex(), **q.jsonable(reply)})
    else:
        render.print_explain(group.strip(), reply)


@auth_app.command("init")
def auth_init(
    out: Annotated[Path, typer.Option("--out", help="Folder to write the config, passwords and env files.")],
    tenant: Annotated[list[str], typer.Option("--tenant", help="A tenant (repeat for several).")],
    shared: Annotated[
        list[str] | None, typer.Option("--shared", help="A shared domain NAME=tenant,tenant (repeatable).")
    ] = None,
    tls: Annotated[bool, typer.Option("--tls", help="Also write a CA and server certificate.")] = False,
) -> None:
    """Write a nats-server config with one user per service and per tenant, subject permissions,
    share domains (salts to tenants only, digests to the directory) and optionally TLS."""
    shared_domains: dict[str, list[str]] = {}
    for item in shared or []:
        name, sep, members = item.partition("=")
        if not sep or not name:
            raise _fail("bad_request", f"--shared wants NAME=tenant,tenant, got {item!r}", EXIT_BAD_INPUT)
        shared_domains[name] = [t for t in members.split(",") if t]
    try:
        plan = auth.plan_auth(tenant, shared_domains)
    except ValueError as exc:
        raise _fail("bad_request", str(exc), EXIT_BAD_INPUT) from None
    doc = auth.write_auth(out, plan, tls=tls)
    render.emit_json({"conf": doc["conf"], "users": sorted(doc["users"]), "grants": doc["grants"]})


def main() -> None:
    app()

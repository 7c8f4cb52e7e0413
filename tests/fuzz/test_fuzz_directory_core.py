"""Fuzz: `DirectoryCore.handle()` fed decoded-but-hostile requests.

Every input is a short script of steps (a request at a time, or a `tick`) run against a small
world (`seeds.directory_world`: three segments, a published group, a building one). Fields are
hostile: wrong ids, stale/future epochs and incarnations, any int msgpack carries, keys and
groups that are real, mutated or noise, ticket ids that exist or not. After every step:
- only `KvfError` subclasses escaped (an `InvariantViolation` or any other exception is a bug);
- `check_invariants()` holds;
- nothing became published except by a `PutCommit` that says so (no published event either);
- the reply and the events encode, as the service shell will have to.
Every request is first encoded and decoded with the service's decoder, so it is a value the
directory can really receive.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, get_args, get_origin, get_type_hints

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.core.directory import DirectoryCore, EmitEvent, FreeSlots, Outcome
from kvfabric.core.directory.keys import chain_of, parse_group, parse_key
from kvfabric.format.errors import KvfError
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.segment import FreeSlotsRequest
from tests.unit.core.dirkit import checksum_of, groups, key

from .fuzzkit import corpus, fuzz_settings, mutated, saving_crash, wide_ints
from .seeds import (
    BUILDING_GROUP,
    BUILDING_KEY,
    DIR_SEGMENTS,
    PUBLISHED_GROUP,
    PUBLISHED_KEY,
    STEPS_DECODER,
    Step,
    directory_world,
)

OTHER_GROUPS: Final = [groups(1, seed=3)[0], groups(1, seed=4, tp_size=2)[0]]
GROUP_IDS: Final = [g.group_id() for g in (PUBLISHED_GROUP, BUILDING_GROUP, *OTHER_GROUPS)]
CHAINS: Final = [g.chain_hash for g in (PUBLISHED_GROUP, BUILDING_GROUP, *OTHER_GROUPS)]
KEYS: Final = [PUBLISHED_KEY, BUILDING_KEY, key(OTHER_GROUPS[0]), key(OTHER_GROUPS[1], rank=1)]
STEPS_MAX: Final = 8

# ---- hostile field values -----------------------------------------------------------------------

texts = st.text(max_size=6)
segment_ids = st.sampled_from([*DIR_SEGMENTS, "s9", ""]) | texts
incarnations = st.sampled_from([1, 2, 0]) | wide_ints()
epochs = st.sampled_from([0, 0, 1, 2]) | wide_ints()
ids = st.integers(0, 8) | wide_ints()  # ticket, lease and pin ids: the world's are small
# Slots outside u32 and generations outside 1..u64 once crashed the commit that packs them
# (corpus `crash-confirm-*`): the confirm now refuses them.
slots = st.integers(0, 8) | wide_ints()
generations = st.integers(0, 3) | wide_ints()
sizes = st.sampled_from([100, 0, -1, 1 << 30, (1 << 30) + 1]) | wide_ints()
checksums = st.sampled_from([checksum_of(k) for k in KEYS]) | st.binary(max_size=20)
writers = st.sampled_from(["w1", "w2", "w3"]) | texts
request_ids = st.sampled_from(["r1", "b2", "c2"]) | texts
ttls = st.sampled_from([1, 1_000, m.LEASE_TTL_MS_MAX, m.LEASE_TTL_MS_MAX + 1, 0]) | wide_ints()
keys = st.sampled_from(KEYS) | mutated(KEYS, rounds_max=1) | st.binary(max_size=100)
group_ids = st.sampled_from(GROUP_IDS) | mutated(GROUP_IDS, rounds_max=1) | st.binary(max_size=100)
any_bytes = st.sampled_from(CHAINS) | st.binary(max_size=40)


def few(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    return st.lists(strategy, max_size=4)


requests: st.SearchStrategy[Any] = st.one_of(
    st.builds(
        m.PutBegin,
        writer_id=writers,
        request_id=request_ids,
        objects=few(
            st.builds(m.ObjectSpec, key=keys, size_bytes=sizes, checksum=checksums, parent=any_bytes)
        ),
        replicas=st.integers(0, 6) | wide_ints(),
        write_ttl_ms=ttls,
        epoch=epochs,
    ),
    st.builds(
        m.ConfirmReplicas,
        segment_id=segment_ids,
        incarnation=incarnations,
        confirms=few(
            st.builds(
                m.ReplicaConfirm,
                ticket_id=ids,
                key=keys,
                slot=slots,
                slot_generation=generations,
                size_bytes=sizes,
                checksum=checksums,
            )
        ),
        epoch=epochs,
    ),
    st.builds(m.PutCommit, writer_id=writers, request_id=request_ids, keys=few(keys), epoch=epochs),
    st.builds(m.PutAbort, writer_id=writers, request_id=request_ids, keys=few(keys), epoch=epochs),
    st.builds(
        m.Lookup,
        holder_id=texts,
        groups=few(group_ids),
        members=few(
            st.builds(m.Member, st.integers(0, 2) | wide_ints(), st.integers(0, 1), st.integers(0, 1))
        ),
        lease_ttl_ms=ttls,
        epoch=epochs,
    ),
    st.builds(m.LeaseRelease, holder_id=texts, lease_id=ids, epoch=epochs),
    st.builds(m.LeaseRenew, holder_id=texts, lease_id=ids, lease_ttl_ms=ttls, epoch=epochs),
    st.builds(m.Pin, holder_id=texts, groups=few(group_ids), ttl_ms=ttls, epoch=epochs),
    st.builds(m.Unpin, holder_id=texts, pin_id=ids, epoch=epochs),
    st.builds(m.Evict, groups=few(group_ids), reason=texts, epoch=epochs),
    st.builds(
        m.SlotsFreed,
        segment_id=segment_ids,
        incarnation=incarnations,
        freed=few(st.builds(m.FreedSlot, any_bytes, slots | wide_ints(), generations | wide_ints())),
        epoch=epochs,
    ),
    st.builds(
        m.Heartbeat,
        segment_id=segment_ids,
        incarnation=incarnations,
        used_bytes=wide_ints(),
        draining=st.booleans(),
        epoch=epochs,
    ),
    st.builds(
        m.RegisterSegment,
        segment_id=segment_ids,
        incarnation=incarnations,
        domain=st.builds(m.FailureDomain, zone=texts, rack=texts, host=texts),
        capacity_bytes=sizes,
        data_addr=texts,
        epoch=epochs,
    ),
    st.builds(
        m.ReplicateBegin,
        writer_id=writers,
        request_id=request_ids,
        key=keys,
        segment_id=segment_ids,
        write_ttl_ms=ttls,
        epoch=epochs,
    ),
    st.builds(
        m.ReplicaCorrupt,
        segment_id=segment_ids,
        incarnation=incarnations,
        key=keys,
        slot=slots | wide_ints(),
        slot_generation=generations | wide_ints(),
        epoch=epochs,
        reason=st.sampled_from(["corrupt", "cold_extra"]) | texts,
    ),
    st.builds(m.ListGroups, domain_digest=any_bytes, after=any_bytes, limit=ids, epoch=epochs),
    st.builds(m.ShowGroup, group=group_ids | any_bytes, epoch=epochs),
    st.builds(m.ListLeases, limit=ids, epoch=epochs),
)


# ---- near-valid requests, built from what the directory handed out so far ----------------------


@dataclass
class Seen:
    """What replies and effects have handed out: the raw material of near-valid requests."""

    tickets: list[m.WriteTicket] = field(default_factory=list)
    leases: list[tuple[str, int]] = field(default_factory=list)  # (holder, lease id)
    pins: list[tuple[str, int]] = field(default_factory=list)  # (holder, pin id)
    frees: list[FreeSlots] = field(default_factory=list)
    # (segment, incarnation, key, slot, generation) of replicas confirmed "ok"
    replicas: list[tuple[str, int, bytes, int, int]] = field(default_factory=list)

    def learn(self, request: Any, outcome: Outcome | None, effects: list[Any]) -> None:
        reply = outcome.reply if outcome is not None else None
        if isinstance(reply, m.PutBeginReply):
            self.tickets.extend(t for r in reply.results for t in r.tickets)
        elif isinstance(reply, m.ReplicateBeginReply) and reply.ticket is not None:
            self.tickets.append(reply.ticket)
        elif isinstance(reply, m.ConfirmReply):
            assert isinstance(request, m.ConfirmReplicas)
            self.replicas.extend(
                (request.segment_id, request.incarnation, c.key, c.slot, c.slot_generation)
                for c, r in zip(request.confirms, reply.results, strict=True)
                if r.status == "ok"
            )
        elif isinstance(reply, m.LookupReply) and reply.lease_id:
            self.leases.append(("h", reply.lease_id))
        elif isinstance(reply, m.PinReply) and reply.pin_id and reply.expires_ms:
            self.pins.append(("h", reply.pin_id))
        self.frees.extend(e for e in effects if isinstance(e, FreeSlots))


# Fields whose values stay in range while the known bug lasts (see `slots` above).
_FIELD_VALUES: Final[dict[str, st.SearchStrategy[Any]]] = {
    "slot": slots,
    "slot_generation": generations,
}


def _hostile_like(owner: msgspec.Struct, name: str, value: object) -> st.SearchStrategy[Any]:
    if name in _FIELD_VALUES:
        return _FIELD_VALUES[name]
    # A field whose type is a closed set (a Literal: `tier` is "dram"/"ssd" in one message and
    # "all"/"ssd" in another): any other value is refused by the decoder before the core sees it
    # (a hostile one goes through `mutated` in the decoder fuzz), so draw its members only.
    hint = get_type_hints(type(owner)).get(name)
    if get_origin(hint) is Literal:
        return st.sampled_from(get_args(hint))
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return wide_ints() | st.integers(-2, 10)
    if isinstance(value, str):
        return texts
    if isinstance(value, bytes):
        return any_bytes | keys | group_ids
    return st.just(value)


def perturb(draw: st.DrawFn, message: Any, rounds_max: int = 2) -> Any:
    """`message` with 0..`rounds_max` fields (top level, or of one nested struct) made hostile."""
    for _ in range(draw(st.integers(0, rounds_max))):
        name = draw(st.sampled_from(message.__struct_fields__))
        value = getattr(message, name)
        if isinstance(value, list) and value and isinstance(value[0], msgspec.Struct):
            i = draw(st.integers(0, len(value) - 1))
            inner = value[i]
            inner_name = draw(st.sampled_from(inner.__struct_fields__))
            new_inner = msgspec.structs.replace(
                inner, **{inner_name: draw(_hostile_like(inner, inner_name, getattr(inner, inner_name)))}
            )
            message = msgspec.structs.replace(message, **{name: [*value[:i], new_inner, *value[i + 1 :]]})
        else:
            message = msgspec.structs.replace(message, **{name: draw(_hostile_like(message, name, value))})
    return message


def near_valid(draw: st.DrawFn, seen: Seen) -> Any:
    """A request that would be accepted, from what `seen` holds, then perturbed."""
    choices = ["begin", "lookup", "pin", "evict", "heartbeat", "replicate"]
    if seen.replicas:
        choices.append("corrupt")
    if seen.tickets:
        choices += ["confirm", "confirm", "commit", "commit", "abort"]
    if seen.leases:
        choices += ["release", "renew"]
    if seen.pins:
        choices.append("unpin")
    if seen.frees:
        choices.append("freed")
    kind = draw(st.sampled_from(choices))
    message: Any
    if kind in ("confirm", "commit", "abort"):
        t = draw(st.sampled_from(seen.tickets))
        if kind == "confirm":
            confirm = m.ReplicaConfirm(
                ticket_id=t.ticket_id,
                key=t.key,
                slot=draw(slots),
                slot_generation=draw(generations),
                size_bytes=t.size_bytes,
                checksum=t.checksum,
            )
            message = m.ConfirmReplicas(
                segment_id=t.segment_id, incarnation=t.incarnation, confirms=[confirm]
            )
        elif kind == "commit":
            message = m.PutCommit(writer_id=t.writer_id, request_id=draw(request_ids), keys=[t.key])
        else:
            message = m.PutAbort(writer_id=t.writer_id, request_id=draw(request_ids), keys=[t.key])
    elif kind == "begin":
        chosen = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
        specs = [m.ObjectSpec(key=k, size_bytes=100, checksum=checksum_of(k)) for k in chosen]
        message = m.PutBegin(writer_id=draw(writers), request_id=draw(request_ids), objects=specs)
    elif kind == "lookup":
        message = m.Lookup(
            holder_id="h", groups=draw(st.lists(st.sampled_from(GROUP_IDS), min_size=1, max_size=3))
        )
    elif kind == "pin":
        message = m.Pin(holder_id="h", groups=[draw(st.sampled_from(GROUP_IDS))], ttl_ms=1_000)
    elif kind == "evict":
        message = m.Evict(groups=draw(st.lists(st.sampled_from(GROUP_IDS), min_size=1, max_size=3)))
    elif kind == "replicate":
        message = m.ReplicateBegin(
            writer_id="r",
            request_id=draw(request_ids),
            key=draw(st.sampled_from(KEYS)),
            segment_id=draw(st.sampled_from(DIR_SEGMENTS)),
        )
    elif kind == "corrupt":
        segment_id, incarnation, k, slot, generation = draw(st.sampled_from(seen.replicas))
        message = m.ReplicaCorrupt(
            segment_id=segment_id,
            incarnation=incarnation,
            key=ObjectKey(k),
            slot=slot,
            slot_generation=generation,
            reason=draw(st.sampled_from(["corrupt", "cold_extra"])),
        )
    elif kind == "heartbeat":
        message = m.Heartbeat(segment_id=draw(st.sampled_from(DIR_SEGMENTS)), incarnation=1, used_bytes=0)
    elif kind in ("release", "renew"):
        holder, lease_id = draw(st.sampled_from(seen.leases))
        message = (
            m.LeaseRelease(holder_id=holder, lease_id=lease_id)
            if kind == "release"
            else m.LeaseRenew(holder_id=holder, lease_id=lease_id)
        )
    elif kind == "unpin":
        holder, pin_id = draw(st.sampled_from(seen.pins))
        message = m.Unpin(holder_id=holder, pin_id=pin_id)
    else:
        free = draw(st.sampled_from(seen.frees))
        message = m.SlotsFreed(
            segment_id=free.segment_id, incarnation=free.incarnation, freed=list(free.slots)
        )
    return perturb(draw, message)


# ---- the checks ---------------------------------------------------------------------------------


def _published_by(outcome: Outcome) -> set[bytes]:
    """Groups a PutCommit reply says it published (or published degraded)."""
    assert isinstance(outcome.reply, m.PutCommitReply)
    return {
        parse_key(r.key).group.group_id
        for r in outcome.reply.results
        if r.status in ("published", "degraded")
    }


def _check_encodable(outcome: Outcome | None, effects: list[Any]) -> None:
    if outcome is not None:
        assert m.reply_decoder.decode(encode(outcome.reply)) == outcome.reply
    for effect in effects:
        if isinstance(effect, EmitEvent):
            assert m.event_decoder.decode(encode(effect.event)) == effect.event
        else:
            assert isinstance(effect, FreeSlots)
            encode(
                FreeSlotsRequest(
                    segment_id=effect.segment_id, incarnation=effect.incarnation, slots=list(effect.slots)
                )
            )


def apply(core: DirectoryCore, step: Step) -> tuple[Outcome | None, list[Any]]:
    """One step and the checks after it. Returns the outcome (None after a tick or an error)."""
    before = set(core.published)
    outcome: Outcome | None = None
    if step.request is None:
        effects: list[Any] = core.tick(step.now_ms)
    else:
        request = m.request_decoder.decode(encode(step.request))  # what the service would see
        assert request == step.request
        with contextlib.suppress(KvfError):  # a typed refusal is a fine answer to hostile input
            outcome = core.handle(request, step.now_ms)
        effects = outcome.effects if outcome is not None else []
    core.check_invariants()
    published_now = set(core.published) - before
    events = {
        e.event.group for e in effects if isinstance(e, EmitEvent) and isinstance(e.event, m.GroupPublished)
    } | {
        g.group
        for e in effects
        if isinstance(e, EmitEvent) and isinstance(e.event, m.GroupsPublished)
        for g in e.event.groups
    }
    allowed = (
        _published_by(outcome) if isinstance(step.request, m.PutCommit) and outcome is not None else set()
    )
    assert published_now <= allowed, f"{type(step.request).__name__} published {len(published_now)} group(s)"
    # A group published before and still published may be published again (its replicas changed
    # tier: a demotion's drop, a kept-source copy, an `evict` with tier "ssd" that kept it, a
    # demotion's disk copy kept by a drop refused under a lease; or a corrupt replica dropped).
    republished = {chain_of(g) for g in before & set(core.published)}
    assert events <= {chain_of(g) for g in allowed} | republished, (
        "a published event (GroupPublished, GroupsPublished) without a commit that published it"
    )
    _check_encodable(outcome, effects)
    return outcome, effects


def run_script(steps: list[Step]) -> DirectoryCore:
    core = directory_world().core
    core.check_invariants()
    for step in steps:
        apply(core, step)
    return core


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in corpus("directory_core")])
def test_directory_core_corpus(path: Path) -> None:
    run_script(STEPS_DECODER.decode(path.read_bytes()))


def test_a_commit_can_publish() -> None:
    """The no-publish check above is not vacuous: the seed script that confirms and commits the
    building group's ticket publishes it."""
    steps = STEPS_DECODER.decode(
        (Path(__file__).parent / "corpus/directory_core/confirm-commit-publishes.msgpack").read_bytes()
    )
    core = run_script(steps)
    assert parse_group(BUILDING_GROUP.to_bytes()).group_id in core.published


@fuzz_settings(600)
@given(st.data())
def test_directory_core_takes_hostile_requests(data: st.DataObject) -> None:
    world = directory_world()
    core, published = world.core, world.published
    seen = Seen(
        tickets=[world.building],
        replicas=[(published.segment_id, published.incarnation, published.key, 0, 1)],
    )
    steps: list[Step] = []
    now = 0
    with saving_crash("directory_core", lambda: msgspec.msgpack.encode(steps)):
        for _ in range(data.draw(st.integers(1, STEPS_MAX), label="steps")):
            now += data.draw(st.integers(0, 3_000) | st.sampled_from([10_000, 100_000, 10**9]), label="dt")
            kind = data.draw(st.sampled_from(["near_valid", "near_valid", "random", "tick"]), label="kind")
            if kind == "tick":
                request = None
            elif kind == "random":
                request = data.draw(requests, label="request")
            else:
                request = data.draw(st.composite(lambda draw: near_valid(draw, seen))(), label="request")
            steps.append(Step(now, request))
            seen.learn(request, *apply(core, steps[-1]))

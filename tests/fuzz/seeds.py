"""The hand-made seeds of the checked-in corpus, and the small worlds the fuzz targets run in.

    python -m tests.fuzz.seeds      # writes every seed file that is missing; never overwrites

Seeds are inputs worth replaying on every run: the golden messages, each kind of malformed frame
or key, and the inputs that once crashed something (`crash-*`, kept as regressions).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from kvfabric.core.directory import DirectoryCore
from kvfabric.dataplane.frames import HEADER, MAGIC, META_BYTES_MAX, OBJECT_BYTES_MAX, READS_MAX, Op
from kvfabric.format.ids import GroupId, ObjectKey
from kvfabric.format.key import KVKey
from kvfabric.format.manifest import MANIFEST_VERSION
from kvfabric.proto import dataplane as dp
from kvfabric.proto import directory as m
from kvfabric.proto.codec import encode
from kvfabric.proto.golden_cases import GOLDEN_CASES
from kvfabric.proto.tickets import sign_ticket
from tests.unit.core.dirkit import checksum_of, groups, key, new_core, register

from .fuzzkit import CORPUS_DIR

REPO: Final = Path(__file__).resolve().parents[2]
GOLDEN_DIR: Final = REPO / "proto_schemas" / "golden"
MANIFEST_VECTOR: Final = REPO / "tests" / "unit" / "format" / "vectors" / "manifest_v1.msgpack"

# ---- the data-plane world: one segment, as the golden dp.put.v1 ticket names it -----------------

SECRET: Final = b"fuzz-cluster-secret-0123456789"
SEGMENT_ID: Final = "s1"
INCARNATION: Final = 9
NOW_MS: Final = 1_000
# The checksum of no payload a fuzz input carries: a correctly signed PUT still stores nothing.
BAD_CHECKSUM: Final = b"c" * 16
BOMB: Final = b"\x91" * 5_000 + b"\xc0"  # nested arrays deeper than any recursion limit


def ticket(size_bytes: int, *, signed: bool = True, **fields: object) -> m.WriteTicket:
    """A write ticket for the fuzzed segment (valid signature unless `signed=False`)."""
    base = m.WriteTicket(
        ticket_id=1,
        key=ObjectKey(bytes(96)),
        segment_id=SEGMENT_ID,
        incarnation=INCARNATION,
        size_bytes=size_bytes,
        checksum=BAD_CHECKSUM,
        writer_id="fuzz",
        deadline_ms=1_000_000,
        epoch=1,
    )
    base = msgspec.structs.replace(base, **fields)
    return sign_ticket(base, SECRET) if signed else base


def frame(
    op: int,
    meta: bytes,
    payload: bytes = b"",
    *,
    request_id: int = 1,
    magic: bytes = MAGIC,
    flags: int = 0,
    reserved: int = 0,
    meta_bytes: int | None = None,
    payload_count: int = 0,
) -> bytes:
    """One data-plane frame with every header field under the caller's control."""
    declared = len(meta) if meta_bytes is None else meta_bytes
    return HEADER.pack(magic, op, flags, reserved, request_id, declared, payload_count) + meta + payload


def _frames() -> dict[str, bytes]:
    mapf = frame(Op.MAP, encode(dp.MapRequest()))
    reads = [dp.ReadRef(INCARNATION, 0, 1, 64), dp.ReadRef(INCARNATION, -1, 0, 0), dp.ReadRef(8, 0, 1, 64)]
    get = encode(dp.GetRequest(reads=reads))
    golden_put = (GOLDEN_DIR / "dp.put.v1.msgpack").read_bytes()
    return {
        "empty.bin": b"",
        "map-ok.bin": mapf,
        "get-unknown-slots.bin": frame(Op.GET, get),
        "pin-unpin-unknown.bin": frame(Op.PIN_LOCAL, get, request_id=2)
        + frame(Op.UNPIN_LOCAL, encode(dp.UnpinLocal(grant_id=1)), request_id=3)
        + frame(Op.UNPIN_LOCAL, encode(dp.UnpinLocal(grant_id=999)), request_id=4),
        "put-golden-unsigned-no-payload.bin": frame(Op.PUT, golden_put),
        "put-signed-bad-checksum-then-map.bin": frame(
            Op.PUT, encode(dp.PutRequest(ticket=ticket(64))), bytes(64), payload_count=1
        )
        + mapf,
        "put-signed-truncated-payload.bin": frame(
            Op.PUT, encode(dp.PutRequest(ticket=ticket(64))), bytes(10)
        ),
        "put-signed-size-zero.bin": frame(Op.PUT, encode(dp.PutRequest(ticket=ticket(0)))) + mapf,
        "put-signed-larger-than-arena.bin": frame(Op.PUT, encode(dp.PutRequest(ticket=ticket(1 << 29)))),
        "put-unsigned-over-object-max.bin": frame(
            Op.PUT, encode(dp.PutRequest(ticket=ticket(OBJECT_BYTES_MAX + 1, signed=False)))
        ),
        "put-wrong-segment.bin": frame(Op.PUT, encode(dp.PutRequest(ticket=ticket(64, segment_id="s2"))))
        + bytes(64)
        + mapf,
        # A refused PUT of negative size made the server `_discard` a negative count (ValueError).
        "crash-put-negative-size.bin": frame(Op.PUT, encode(dp.PutRequest(ticket=ticket(-1, signed=False)))),
        # A meta nested deeper than the recursion limit escaped the decoder as RecursionError.
        "crash-meta-nested-bomb.bin": frame(Op.GET, b"\x82\xa1z" + BOMB + b"\xa1t\xa9dp.get.v1"),
        "bad-magic.bin": frame(Op.MAP, encode(dp.MapRequest()), magic=b"KVD2"),
        "unknown-op.bin": frame(7, encode(dp.MapRequest())),
        "flags-set.bin": frame(Op.MAP, encode(dp.MapRequest()), flags=1),
        "reserved-set.bin": frame(Op.MAP, encode(dp.MapRequest()), reserved=1),
        "meta-over-max.bin": frame(Op.MAP, b"", meta_bytes=META_BYTES_MAX + 1),
        "payload-count-over-max.bin": frame(Op.GET, get, payload_count=READS_MAX + 1),
        "short-header.bin": frame(Op.MAP, b"")[:10],
        "meta-shorter-than-declared.bin": frame(Op.MAP, encode(dp.MapRequest()), meta_bytes=100),
        "meta-not-msgpack.bin": frame(Op.MAP, b"\xc1\xc1\xc1") + mapf,
        "op-meta-mismatch.bin": frame(Op.PUT, get) + mapf,
        "reply-op-from-client.bin": frame(
            Op.REPLY, encode(dp.PutReply(slot=0, slot_generation=1, confirmed=True))
        )
        + mapf,
        "error-op-from-client.bin": frame(Op.ERROR, (GOLDEN_DIR / "common.error.busy.msgpack").read_bytes()),
        "get-over-reads-max.bin": frame(
            Op.GET, encode(dp.GetRequest(reads=[dp.ReadRef(INCARNATION, 0, 1, 1)] * (READS_MAX + 1)))
        )
        + mapf,
    }


def _decoders() -> dict[str, bytes]:
    out = {f"golden-{p.name}": p.read_bytes() for p in sorted(GOLDEN_DIR.glob("*.msgpack"))}
    out.update(
        {
            "empty.bin": b"",
            "not-msgpack.bin": b"\xc1not msgpack",
            "unknown-tag.msgpack": msgspec.msgpack.encode({"t": "no.such.tag.v9"}),
            "tag-not-a-string.msgpack": msgspec.msgpack.encode({"t": 5}),
            "array32-claims-4g-items.bin": b"\xdd\xff\xff\xff\xff",
            "map32-claims-4g-pairs.bin": b"\xdf\xff\xff\xff\xff",
            "bin32-claims-4gb.bin": b"\x81\xa1t\xc6\xff\xff\xff\xff",
            "error-details-ext-timestamp.msgpack": msgspec.msgpack.encode(
                {"code": "busy", "message": "m", "details": {"at": msgspec.msgpack.Ext(-1, b"\x00" * 4)}}
            ),
            "error-details-deep-but-legal.msgpack": msgspec.msgpack.encode(
                {"code": "busy", "message": "m", "details": {"x": msgspec.Raw(b"\x91" * 100 + b"\xc0")}}
            ),
            # Nested arrays in a field (skipped or typed Any) escaped every FamilyDecoder as
            # RecursionError instead of BadRequest.
            "crash-nested-bomb-before-tag.msgpack": b"\x82\xa1z" + BOMB + b"\xa1t\xabecho.say.v1",
            "crash-nested-bomb-in-error-details.msgpack": (
                b"\x83\xa4code\xa1x\xa7message\xa1y\xa7details\x81\xa1d" + BOMB
            ),
        }
    )
    return out


def _manifest() -> dict[str, bytes]:
    return {
        "vector-manifest_v1.msgpack": MANIFEST_VECTOR.read_bytes(),
        "version-99.msgpack": msgspec.msgpack.encode({"v": 99}),
        "version-only.msgpack": msgspec.msgpack.encode({"v": MANIFEST_VERSION}),
        # The lenient header decoder skips unknown fields recursively: RecursionError escaped.
        "crash-nested-bomb-before-version.msgpack": b"\x82\xa1z" + BOMB + b"\xa1v\x01",
    }


def _keys() -> dict[str, bytes]:
    g = groups(1, tp_size=2)[0]
    k = KVKey(chunk_group=g, tp_rank=1, pp_stage=0, layer_group=0)
    kb, gb = k.to_bytes(), g.to_bytes()

    def with_byte(raw: bytes, i: int, value: int) -> bytes:
        return raw[:i] + bytes([value]) + raw[i + 1 :]

    return {
        "key.bin": kb,
        "group.bin": gb,
        "key-text.txt": str(k).encode(),
        "group-text.txt": str(g).encode(),
        "key-encoding-2.bin": with_byte(kb, 0, 2),
        "key-reserved-set.bin": with_byte(kb, 1, 1),
        "key-format-0.bin": with_byte(with_byte(kb, 2, 0), 3, 0),
        "key-tp-size-0.bin": with_byte(with_byte(kb, 36, 0), 37, 0),
        "key-rank-over-size.bin": with_byte(kb, 90, 2),
        "key-95-bytes.bin": kb[:95],
        "group-89-bytes.bin": gb[:89],
        "key-text-encoding-9.txt": str(k).replace("kvf1:", "kvf9:", 1).encode(),
        "key-text-huge-numbers.txt": str(k).replace(":c4:", ":c99999999999:", 1).encode(),
        "group-text-bad-hex.txt": str(g)[:-1].encode() + b"g",
        "all-zero-key.bin": bytes(96),
        "empty.bin": b"",
    }


# ---- the directory world: a core with segments, one published and one building group -----------


class Step(msgspec.Struct, frozen=True, array_like=True):
    """One step of a directory-core fuzz input: `request` at `now_ms`, or a `tick` when None."""

    now_ms: int
    request: m.DirectoryRequest | None = None


STEPS_DECODER: Final = msgspec.msgpack.Decoder(list[Step])
DIR_SEGMENTS: Final = ("s1", "s2", "s3")
PUBLISHED_GROUP: Final = groups(1, seed=1)[0]
BUILDING_GROUP: Final = groups(1, seed=2)[0]
PUBLISHED_KEY: Final = key(PUBLISHED_GROUP)
BUILDING_KEY: Final = key(BUILDING_GROUP)


@dataclass(frozen=True)
class DirectoryWorld:
    core: DirectoryCore
    published: m.WriteTicket  # its replica is (segment, incarnation 1, slot 0, generation 1)
    building: m.WriteTicket  # placed, not confirmed


def _begin(core: DirectoryCore, writer: str, request_id: str, k: ObjectKey) -> m.WriteTicket:
    spec = m.ObjectSpec(key=k, size_bytes=100, checksum=checksum_of(k))
    reply = core.handle(m.PutBegin(writer_id=writer, request_id=request_id, objects=[spec]), 0).reply
    assert isinstance(reply, m.PutBeginReply) and reply.results[0].status == "placed"
    return reply.results[0].tickets[0]


def directory_world() -> DirectoryWorld:
    """Three segments, a published group (writer w1) and a building one (writer w2, its ticket
    not yet confirmed). Deterministic: the same ids every time."""
    core = new_core()
    for seg in DIR_SEGMENTS:
        register(core, seg)
    published = _begin(core, "w1", "r1", PUBLISHED_KEY)
    c = m.ReplicaConfirm(
        ticket_id=published.ticket_id, key=PUBLISHED_KEY, slot=0, slot_generation=1, size_bytes=100,
        checksum=published.checksum,
    )  # fmt: skip
    core.handle(m.ConfirmReplicas(segment_id=published.segment_id, incarnation=1, confirms=[c]), 0)
    commit = core.handle(m.PutCommit(writer_id="w1", request_id="r1c", keys=[PUBLISHED_KEY]), 0).reply
    assert isinstance(commit, m.PutCommitReply) and commit.results[0].status == "published"
    return DirectoryWorld(core, published, _begin(core, "w2", "b2", BUILDING_KEY))


def _directory_core() -> dict[str, bytes]:
    world = directory_world()
    t = world.building

    def confirm(slot: int, generation: int = 1) -> m.ConfirmReplicas:
        c = m.ReplicaConfirm(
            ticket_id=t.ticket_id, key=t.key, slot=slot, slot_generation=generation, size_bytes=100,
            checksum=t.checksum,
        )  # fmt: skip
        return m.ConfirmReplicas(segment_id=t.segment_id, incarnation=t.incarnation, confirms=[c])

    commit = m.PutCommit(writer_id="w2", request_id="c2", keys=[BUILDING_KEY])
    copy_to = next(seg for seg in DIR_SEGMENTS if seg != world.published.segment_id)
    replicate = m.ReplicateBegin(writer_id="r", request_id="rep", key=PUBLISHED_KEY, segment_id=copy_to)
    placed = world.core.handle(replicate, 10).reply
    assert isinstance(placed, m.ReplicateBeginReply) and placed.ticket is not None
    extra = placed.ticket

    def confirm_extra(slot: int) -> m.ConfirmReplicas:
        c = m.ReplicaConfirm(
            ticket_id=extra.ticket_id, key=extra.key, slot=slot, slot_generation=1,
            size_bytes=extra.size_bytes, checksum=extra.checksum,
        )  # fmt: skip
        return m.ConfirmReplicas(segment_id=extra.segment_id, incarnation=extra.incarnation, confirms=[c])

    def steps(*items: Step) -> bytes:
        return msgspec.msgpack.encode(list(items))

    golden = {name: value for name, (family, value) in GOLDEN_CASES.items() if family == "directory.request"}
    out = {f"golden-{name}.msgpack": steps(Step(10, req)) for name, req in golden.items()}  # type: ignore[arg-type]
    out.update(
        {
            "confirm-commit-publishes.msgpack": steps(Step(10, confirm(7)), Step(20, commit), Step(30)),
            "evict-published-then-freed.msgpack": steps(
                Step(10, m.Evict(groups=[PUBLISHED_GROUP.group_id()])),
                Step(
                    20,
                    m.SlotsFreed(segment_id="s1", incarnation=1, freed=[m.FreedSlot(ObjectKey(b""), 0, 1)]),
                ),
                Step(
                    30,
                    m.SlotsFreed(segment_id="s2", incarnation=1, freed=[m.FreedSlot(ObjectKey(b""), 0, 1)]),
                ),
                Step(
                    40,
                    m.SlotsFreed(segment_id="s3", incarnation=1, freed=[m.FreedSlot(ObjectKey(b""), 0, 1)]),
                ),
            ),
            "lookup-identity-mismatch.msgpack": steps(
                Step(
                    10,
                    m.Lookup(
                        holder_id="h",
                        groups=[GroupId(BUILDING_GROUP.group_id()[:58] + PUBLISHED_GROUP.chain_hash)],
                    ),
                )
            ),
            "time-jump-segments-down.msgpack": steps(Step(10**9), Step(10**9 + 1, commit)),
            # The directory takes any int for a confirmed slot, but its published record packs
            # slot as u32 and generation as u64: the commit raised struct.error half-way (tickets
            # gone, group still building). Fix: range-check ReplicaConfirm.slot/slot_generation.
            "crash-confirm-slot-over-u32.msgpack": steps(Step(10, confirm(2**32)), Step(20, commit)),
            "crash-confirm-negative-generation.msgpack": steps(Step(10, confirm(3, -1)), Step(20, commit)),
            # The same for an extra replica (replicate_begin): its confirm packs the published
            # record at once, so a negative slot raised struct.error in ConfirmReplicas itself.
            "crash-confirm-extra-replica-negative-slot.msgpack": steps(
                Step(10, replicate),
                Step(20, confirm_extra(-1)),
            ),
        }
    )
    return out


SEEDS: Final = {
    "frames": _frames,
    "decoders": _decoders,
    "manifest": _manifest,
    "keys": _keys,
    "directory_core": _directory_core,
}


def write_seeds() -> int:
    written = 0
    for target, build in SEEDS.items():
        folder = CORPUS_DIR / target
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in build().items():
            path = folder / name
            if not path.exists():
                path.write_bytes(data)
                written += 1
                print(f"wrote {path.relative_to(REPO)}")
    print(f"{written} new seed file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(write_seeds())

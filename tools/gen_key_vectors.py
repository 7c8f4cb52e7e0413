"""Write the test vectors that pin the KV key hash chain and the manifest v1 encoding forever.

    python tools/gen_key_vectors.py            # write the files that do not exist yet
    python tools/gen_key_vectors.py --check    # exit 1 if the current code disagrees with them

Writes, under tests/unit/format/vectors/:
- key_vectors.json: fixed inputs -> chain hashes, readable keys, binary keys, chunk groups, shards;
- manifest_v1.msgpack + manifest_v1.expected.json: a golden manifest and its decoded value.

Never overwrites an existing file: once checked in, a vector changes only by a deliberate
`git rm` and a new FORMAT_VERSION (a changed hash means every stored object is orphaned).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from kvfabric.format import (
    ChunkEntry,
    KVLayout,
    Manifest,
    ModelFingerprint,
    ObjectEntry,
    ShareDomain,
    checksum,
    chunk_groups_for_prefix,
    digest_config,
    encode_manifest,
    keys_for_prefix,
)

VECTORS_DIR = Path(__file__).resolve().parent.parent / "tests" / "unit" / "format" / "vectors"
SHARDS = 1024

# Inputs. Tokens and extras are chosen to hit the edges: 0, 2**32-1, empty extras, a partial chunk.
INPUTS: list[dict[str, Any]] = [
    {
        "name": "single-rank-basic",
        "tenant_id": "tenant-a",
        "salt_hex": bytes(range(32)).hex(),
        "model": {
            "model_id": "meta-llama/Llama-3.1-8B-Instruct",
            "weights_revision": "0e9e39f249a16976918f6564b8830bc894c89659",
            "kv_dtype": "bfloat16",
            "attn_config_digest": digest_config({"rope_theta": 500000.0, "rope_scaling": {"factor": 8.0}}),
        },
        "layout": {
            "tp_size": 1,
            "tp_rank": 0,
            "pp_stage": 0,
            "layer_group": 0,
            "layer_group_count": 1,
            "tokens_per_chunk": 16,
            "tensor_layout": "vllm:NHD:block16",
        },
        "format_version": 1,
        "tokens": list(range(128000, 128050)),
        "extras": {},
    },
    {
        "name": "tp-pp-lora-fp8-extras",
        "tenant_id": "tenant-b",
        "salt_hex": (b"\xa5" * 15 + b"\x01").hex(),
        "model": {
            "model_id": "Qwen/Qwen2-VL-7B",
            "weights_revision": "sha256:51c47430f97dd7c74aa1fa6825e68a813478097f",
            "lora_id": "support-bot",
            "lora_revision": "v7",
            "kv_dtype": "fp8_e4m3",
            "kv_quant": "fp8:per-tensor:scale=0.0625",
            "attn_config_digest": digest_config({"mrope_section": [16, 24, 24]}),
        },
        "layout": {
            "tp_size": 4,
            "tp_rank": 3,
            "pp_size": 2,
            "pp_stage": 1,
            "layer_group": 1,
            "layer_group_count": 3,
            "tokens_per_chunk": 4,
            "tensor_layout": "vllm:HND:block4",
        },
        "format_version": 1,
        "tokens": [0, 4294967295, 7, 151652, 151655, 151655, 151655, 151653, 9, 10, 11, 12, 13, 14],
        "extras": {"1": [bytes.fromhex("00112233445566778899aabbccddeeff").hex()], "2": ["", "78"]},
    },
    {
        "name": "unicode-tenant-max-salt-chunk1",
        "tenant_id": "租户-ü",
        "salt_hex": bytes(range(255, 191, -1)).hex(),
        "model": {
            "model_id": "m",
            "weights_revision": "r",
            "kv_dtype": "float16",
            "attn_config_digest": "none",
        },
        "layout": {
            "tp_size": 65535,
            "tp_rank": 65534,
            "pp_stage": 0,
            "layer_group": 0,
            "layer_group_count": 1,
            "tokens_per_chunk": 1,
            "tensor_layout": "raw",
        },
        "format_version": 1,
        "tokens": [0, 1, 4294967295],
        "extras": {"0": ["ff" * 40]},
    },
]


def build_inputs(
    v: dict[str, Any],
) -> tuple[ShareDomain, ModelFingerprint, KVLayout, list[int], dict[int, list[bytes]]]:
    domain = ShareDomain(v["tenant_id"], bytes.fromhex(v["salt_hex"]))
    model = ModelFingerprint(**v["model"])
    layout = KVLayout(**v["layout"])
    extras = {int(k): [bytes.fromhex(x) for x in items] for k, items in v["extras"].items()}
    return domain, model, layout, list(v["tokens"]), extras


def compute_vector(v: dict[str, Any]) -> dict[str, Any]:
    """The expected outputs for one input; the test calls this same shape of computation."""
    domain, model, layout, tokens, extras = build_inputs(v)
    fv = v["format_version"]
    keys = keys_for_prefix(domain, model, layout, tokens, extras, format_version=fv)
    groups = chunk_groups_for_prefix(domain, model, layout, tokens, extras, format_version=fv)
    return {
        **v,
        "expected": {
            "chain_hex": [g.chain_hash.hex() for g in groups],
            "keys": [str(k) for k in keys],
            "keys_hex": [k.to_bytes().hex() for k in keys],
            "groups": [str(g) for g in groups],
            f"shard_{SHARDS}": [g.shard(SHARDS) for g in groups],
        },
    }


def key_vectors_json() -> str:
    doc = {
        "comment": "Pinned forever: generated once by tools/gen_key_vectors.py. See docs/formats.md.",
        "vectors": [compute_vector(v) for v in INPUTS],
    }
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def golden_manifest() -> Manifest:
    """Two TP ranks x two layer groups, four chunks; chunk 2 misses member (1, 0, 1)."""
    domain = ShareDomain("tenant-a", bytes(range(32)))
    model = ModelFingerprint(
        model_id="meta-llama/Llama-3.1-8B-Instruct",
        weights_revision="0e9e39f249a16976918f6564b8830bc894c89659",
        kv_dtype="bfloat16",
        attn_config_digest="none",
    )
    layout = KVLayout(
        tp_size=2,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=2,
        tokens_per_chunk=16,
        tensor_layout="vllm:NHD:block16",
    )
    groups = chunk_groups_for_prefix(domain, model, layout, list(range(64)))
    chunks = []
    for g in groups:
        objects = []
        for r in range(2):
            for lg in range(2):
                if g.chunk_index == 2 and (r, lg) == (1, 1):
                    continue
                payload = f"chunk {g.chunk_index} rank {r} group {lg}".encode()
                objects.append(
                    ObjectEntry(
                        tp_rank=r, pp_stage=0, layer_group=lg, size_bytes=131072, checksum=checksum(payload)
                    )
                )
        chunks.append(ChunkEntry(chunk_index=g.chunk_index, chain_hash=g.chain_hash, objects=tuple(objects)))
    return Manifest.for_group(groups[0], chunks)


def outputs() -> dict[str, bytes]:
    m = golden_manifest()
    return {
        "key_vectors.json": key_vectors_json().encode(),
        "manifest_v1.msgpack": encode_manifest(m),
        "manifest_v1.expected.json": msgspec.json.format(msgspec.json.encode(m), indent=1) + b"\n",
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="compare with the checked-in files, write nothing"
    )
    args = parser.parse_args()
    VECTORS_DIR.mkdir(parents=True, exist_ok=True)
    status = 0
    for name, data in outputs().items():
        path = VECTORS_DIR / name
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                print(f"DIFFERS: {path}")
                status = 1
            else:
                print(f"ok: {path.name}")
        elif path.exists():
            print(f"kept (never overwritten): {path.name}")
        else:
            path.write_bytes(data)
            print(f"wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""HF transformers adapter: load a stored prefix's KV into a `DynamicCache`, compute only the
suffix, save the prompt's new chunks. The light path (no vLLM) for demos and small deployments.

Object layout (`TENSOR_LAYOUT`, part of every key): one object per (chunk, member) holds, for each
layer in order, K then V of that chunk, each `[num_kv_heads, tokens_per_chunk, head_dim]`,
contiguous, in the cache dtype (batch 1). The model fingerprint carries the dtype, the weights
digest and the attention config, so a different model, dtype or checkpoint never shares KV.

Ownership: `load_prefix` hands the client buffers it allocated itself and builds the cache only
from the verified prefix the client reports; `save_prefix` copies the chunks out of the cache
(the client owns the copies), so the caller may keep using or drop the cache at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import torch

from kvfabric.client import EngineSpec, Hit, KvClient, SaveResult
from kvfabric.client.save_memory import SaveSlots, client_save_slots
from kvfabric.engines.identity import (
    LONGROPE_UNCACHEABLE,
    attn_config_digest,
    longrope_long_factors,
    rope_entries,
)
from kvfabric.format.key import KVLayout, ModelFingerprint, ShareDomain

__all__ = [
    "DYNAMIC_ROPE_UNCACHEABLE",
    "TENSOR_LAYOUT",
    "GenerateResult",
    "HfKvAdapter",
    "PrefixLoad",
    "hf_engine_spec",
    "weights_digest",
]

log = logging.getLogger("kvfabric.engines.hf")

TENSOR_LAYOUT: Final = "hf-dynamic-cache.v1:per-layer-k-then-v:[kvh,tokens,head_dim]"

# transformers' dynamic-NTK RoPE (`dynamic_rope_update`, any rope type naming "dynamic": it tests
# `"dynamic" in rope_type`) recomputes the rotary frequencies from a forward's largest position
# once that passes `max_position_embeddings`, and keeps them across calls (`max_seq_len_cached`):
# a prefix saved from a 6,000-token prompt was rotated for another length than a recompute of a
# 6,120-token one uses (review, stop 71). The only other rope type whose frequencies follow the
# sequence at run time is LongRoPE (`LONGROPE_UNCACHEABLE`); linear, yarn, llama3 and
# proportional are fixed by the config (transformers 5.19, `ROPE_INIT_FUNCTIONS`).
DYNAMIC_ROPE_UNCACHEABLE: Final = (
    "kvfabric: {model!r} uses dynamic-NTK RoPE (rope_type {rope_type!r}), which {engine} rescales"
    " per forward call (from the call's largest position once past max_position_embeddings, kept"
    " for later calls): a prefix's KV depends on the batch and on the calls before it, so it is not"
    " cached"
)
# A chunk another writer is storing (the directory's `in_flight`): it will be there, so the chunks
# after it stay reachable (as the vLLM connector's `IN_FLIGHT`).
IN_FLIGHT: Final = "in_flight"
# The cause of a prefix's save part the client did not start (off, or closed under the chain) or
# that raised, and of the parts after it (the vLLM connector's `dropped`).
CAUSE_DROPPED: Final = "dropped"


def weights_digest(model: torch.nn.Module) -> str:
    """xxh3-128 of every parameter and buffer (name, dtype, shape, bytes). Seconds per GB."""
    import xxhash

    h = xxhash.xxh3_128()
    for name, tensor in sorted([*model.state_dict().items()]):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
    return "xxh3:" + h.hexdigest()


def _dims(model: torch.nn.Module) -> tuple[int, int, int]:
    cfg: Any = _text_config(model.config)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def _text_config(config: Any) -> Any:
    """The config the attention reads: a composite model's (vision-language) text config, whose
    fields its top level leaves None (review, stop 66: a rope override was not in the key)."""
    getter = getattr(config, "get_text_config", None)
    if not callable(getter):
        return config
    try:
        return getter(decoder=True)  # (a config with a text encoder too: the decoder's)
    except TypeError:  # an older transformers without `decoder`
        return getter()


def _dynamic_rope_type(hf_config: Mapping[str, Any]) -> str | None:
    """The rope type of a dynamic-NTK rope in an HF config dict (`rope_parameters` or the older
    `rope_scaling`; one rope or one per layer type; a composite model's `text_config` too), or
    None: its frequencies follow each forward's positions (`DYNAMIC_ROPE_UNCACHEABLE`)."""
    return next((t for _, _, t in rope_entries(hf_config) if "dynamic" in t), None)


def hf_engine_spec(
    model: torch.nn.Module,
    domain: ShareDomain,
    *,
    tokens_per_chunk: int = 256,
    model_id: str | None = None,
    weights_revision: str | None = None,
) -> EngineSpec:
    """The key space of `model`: its id, weights (digest unless a revision is given), cache
    dtype and attention config; one member (TP 1, PP 1, one layer group). Raises ValueError for
    a model whose rotary frequencies transformers picks per forward call (LongRoPE, dynamic-NTK
    RoPE: a prefix's KV depends on what it was computed beside; stop 70, review, stop 71)."""
    dtype = next(model.parameters()).dtype
    name = model_id or str(getattr(model.config, "name_or_path", "") or type(model).__name__)
    text_config = _text_config(model.config).to_dict()
    if longrope_long_factors(text_config, 0) is not None:
        raise ValueError(LONGROPE_UNCACHEABLE.format(engine="transformers", model=name))
    if (rope_type := _dynamic_rope_type(text_config)) is not None:
        raise ValueError(
            DYNAMIC_ROPE_UNCACHEABLE.format(engine="transformers", model=name, rope_type=rope_type)
        )
    fingerprint = ModelFingerprint(
        model_id=name[:200],
        weights_revision=weights_revision or weights_digest(model),
        kv_dtype=str(dtype).removeprefix("torch."),
        attn_config_digest=attn_config_digest(text_config),
    )
    layout = KVLayout(
        tp_size=1,
        tp_rank=0,
        pp_stage=0,
        layer_group=0,
        layer_group_count=1,
        tokens_per_chunk=tokens_per_chunk,
        tensor_layout=TENSOR_LAYOUT,
    )
    return EngineSpec(domain=domain, model=fingerprint, layout=layout)


def _cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values), position i at index i. Only a cache whose every layer keeps
    every position: a sliding-window layer keeps the last tokens only, a quantized one its recent
    part, and a chunk cut from them by position held other tokens' KV, saved under the right
    keys (review, stop 66: a Gemma2 cache the model made itself). Raises ValueError otherwise."""
    if hasattr(cache, "layers"):
        kept_in_part = {type(layer).__name__ for layer in cache.layers} - {"DynamicLayer"}
        if kept_in_part:
            raise ValueError(f"a cache with {sorted(kept_in_part)} layers does not keep every position")
        return [(layer.keys, layer.values) for layer in cache.layers]
    if type(cache).__name__ != "DynamicCache":  # transformers 4.x: its sliding and static caches too
        raise ValueError(f"a {type(cache).__name__} does not keep every position")
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


@dataclass(frozen=True, slots=True)
class PrefixLoad:
    cache: Any  # a DynamicCache holding `tokens` tokens, or None
    tokens: int
    hit: Hit
    load_s: float


@dataclass(frozen=True, slots=True)
class GenerateResult:
    token_ids: list[int]  # the new tokens only
    loaded_tokens: int
    computed_tokens: int  # prompt tokens the model really ran (prefill)
    prefill_s: float  # lookup + load + suffix forward, up to the first token's logits
    load_s: float
    saving: concurrent.futures.Future[SaveResult] | None = None  # the prompt's save, if started


@dataclass(slots=True)
class _SavePart:
    """Chunks `first_chunk..end_chunk-1` of a prefix's save, one client save."""

    first_chunk: int
    end_chunk: int
    objects: list[list[memoryview]] = field(default_factory=list)  # its copies, until it is sent
    taken: list[int] = field(default_factory=list)  # its save slots, until it is sent
    result: SaveResult | None = None  # once it ended, or was not sent


def _sum_results(results: Sequence[SaveResult]) -> SaveResult:
    """One prefix's result from its parts'."""
    causes: dict[str, int] = {}
    for result in results:
        for cause, n in result.causes.items():
            causes[cause] = causes.get(cause, 0) + n
    return SaveResult(
        chunks_saved=sum(r.chunks_saved for r in results),
        chunks_existing=sum(r.chunks_existing for r in results),
        chunks_failed=sum(r.chunks_failed for r in results),
        bytes_written=sum(r.bytes_written for r in results),
        causes=causes,
    )


class HfKvAdapter:
    """Runs one causal LM (batch 1) with kvfabric underneath."""

    def __init__(self, model: torch.nn.Module, client: KvClient) -> None:
        self.model = model
        self.client = client
        self.tpc = client.aio.spec.layout.tokens_per_chunk
        self.layers, self.kv_heads, self.head_dim = _dims(model)
        self.dtype = next(model.parameters()).dtype
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.chunk_bytes = self.layers * 2 * self.kv_heads * self.tpc * self.head_dim * itemsize
        self._save_slots: SaveSlots | Literal[False] | None = None  # made at the first save (False: none)

    # ---- load ------------------------------------------------------------------------------

    def load_prefix(self, token_ids: Sequence[int], *, trace_id: str | None = None) -> PrefixLoad:
        """The longest stored prefix (never the whole prompt: the last token is computed, its
        logits are needed) as a cache. Any failure gives a shorter prefix, never an error."""
        from transformers import DynamicCache

        started = time.perf_counter()
        try:
            hit = self.client.lookup(token_ids, max_tokens=len(token_ids) - 1, trace_id=trace_id)
        except Exception as exc:  # the client's loop stalled past its timeout: a miss
            log.warning("kvfabric: lookup raised %r: computed in full", exc)
            return PrefixLoad(None, 0, Hit(0, self.tpc, (), ()), time.perf_counter() - started)
        if hit.tokens == 0:
            self.client.release(hit)
            return PrefixLoad(None, 0, hit, time.perf_counter() - started)
        n = hit.chunks
        # The cache tensors themselves are the destinations: chunk c's object scatters, per layer,
        # K then V, per KV head, into the [tokens of c, head_dim] slice (contiguous). No staging
        # copy, no permute; only the verified prefix is handed to the model.
        kv = torch.empty((self.layers, 2, 1, self.kv_heads, n * self.tpc, self.head_dim), dtype=self.dtype)
        dests = [
            [
                [
                    kv[layer, kind, 0, head, c * self.tpc : (c + 1) * self.tpc]
                    .reshape(-1)
                    .view(torch.uint8)
                    .numpy()
                    .data
                    for layer in range(self.layers)
                    for kind in (0, 1)
                    for head in range(self.kv_heads)
                ]
            ]
            for c in range(n)
        ]
        try:
            result = self.client.load(hit, dests)
        except Exception as exc:  # e.g. an object of another size than this model's chunk: a miss
            log.warning("kvfabric: load raised %r: computed in full", exc)
            self.client.release(hit)
            return PrefixLoad(None, 0, hit, time.perf_counter() - started)
        loaded = result.tokens // self.tpc
        if loaded == 0:
            self.client.release(hit)
            return PrefixLoad(None, 0, hit, time.perf_counter() - started)
        cache = DynamicCache()
        end = loaded * self.tpc
        device = next(self.model.parameters()).device  # loaded into host memory, used there
        for layer in range(self.layers):
            keys, values = kv[layer, 0, :, :, :end], kv[layer, 1, :, :, :end]
            cache.update(keys.to(device), values.to(device), layer)
        return PrefixLoad(cache, loaded * self.tpc, hit, time.perf_counter() - started)

    # ---- save ------------------------------------------------------------------------------

    def chunk_objects(
        self, cache: Any, first_chunk: int, last_chunk: int, taken: list[int] | None = None
    ) -> list[list[memoryview]]:
        """Copies of chunks `first_chunk..last_chunk-1` of `cache` in the object layout. With
        `taken`, each into a free slot of the adapter's save memory (its number appended: a
        co-located segment reads it in place, `KvClient.save_memory`), else into memory of its
        own."""
        layers = _cache_layers(cache)
        slots = self._slots() if taken is not None else None
        objects: list[list[memoryview]] = []
        for c in range(first_chunk, last_chunk):
            s, e = c * self.tpc, (c + 1) * self.tpc
            parts = [t[0, :, s:e, :].reshape(-1) for k, v in layers for t in (k, v)]
            slot = slots.take() if slots is not None else None
            if slots is None or slot is None or taken is None:
                blob = torch.cat(parts).contiguous()
                objects.append([blob.view(torch.uint8).numpy().data])
                continue
            taken.append(slot)
            out = slots.array(slot)
            torch.cat(parts, out=torch.frombuffer(out, dtype=self.dtype))
            objects.append([out.data])
        return objects

    def _slots(self) -> SaveSlots | None:
        """The adapter's save slots, one chunk object each."""
        if self._save_slots is None:
            self._save_slots = client_save_slots(self.client, self.chunk_bytes) or False
        return self._save_slots or None

    def save_prefix(
        self, token_ids: Sequence[int], cache: Any, *, first_chunk: int = 0, trace_id: str | None = None
    ) -> concurrent.futures.Future[SaveResult] | None:
        """Save the full chunks of `token_ids` from `first_chunk` on (asynchronous; None when the
        client dropped it, or the copy out of `cache` raised: logged, never an error in the
        caller's generation). `cache` must hold at least those tokens.

        The chunks go as consecutive saves of at most half the client's
        `save_inflight_bytes_max` each (whole chunks, at least one), head first: each starts
        once the one before it has ended with every chunk stored (the client admits a save
        whole, so one prompt's KV past the bound, a Llama-3-8B bf16 prompt over ~4,096 tokens at
        the default 512 MiB, was dropped whole, `bytes`, and never stored; review, stop 71; as
        SGLang's chained batches, stop 68). A part that leaves a chunk unstored (but `in_flight`:
        another writer stores it) ends the chain: a lookup stops at that chunk, so the chunks
        after it would be stored where nobody finds them; each part not sent is counted once
        (`saves_dropped_total` under that chunk's cause; a part the client dropped itself, off,
        is its own under `closed` / `starting`, the parts after it `dropped`; review, stop 71:
        that part was counted twice, and the parts after a first part so dropped not at all)
        and its chunks fail under that cause (`dropped` for the client's) in the future's one
        `SaveResult` of the whole prefix. Every chunk is copied out at once (the caller may drop
        `cache`): the copies of the parts not sent yet are this adapter's, up to one prompt's
        KV in host memory."""
        parts: list[_SavePart] = []
        try:
            held = min(keys.shape[2] for keys, _ in _cache_layers(cache))  # (every layer's)
            last_chunk = min(len(token_ids), held) // self.tpc
            if last_chunk <= first_chunk:
                return None
            per_save = max(1, self.client.settings.save_inflight_bytes_max // 2 // self.chunk_bytes)
            for start in range(first_chunk, last_chunk, per_save):
                part = _SavePart(start, min(start + per_save, last_chunk))
                parts.append(part)  # (before its copy: a copy that raises gives its slots back)
                part.objects = self.chunk_objects(cache, part.first_chunk, part.end_chunk, part.taken)
            tokens = list(token_ids[: last_chunk * self.tpc])
            first = self._save_part(tokens, parts[0], trace_id)
        except BaseException as exc:
            self._give_back(parts)
            if not isinstance(exc, Exception):
                raise
            # a cache of another layout, save memory closed under it (the client closed): the
            # prompt is not saved, the caller's generation goes on
            log.warning("kvfabric: save raised %r: not saved", exc)
            return None
        if first is None:  # the client is off: it dropped (and counted) the first part
            self._drop_parts(parts[1:], CAUSE_DROPPED)  # and so the rest, each counted
            return None
        if len(parts) == 1:
            return first
        chained: concurrent.futures.Future[SaveResult] = concurrent.futures.Future()
        chained.set_running_or_notify_cancel()  # (its holder cannot cancel it: as `save_async`'s)
        first.add_done_callback(lambda done: self._part_ended(tokens, parts, 0, done, chained, trace_id))
        return chained

    def _save_part(
        self, tokens: list[int], part: _SavePart, trace_id: str | None
    ) -> concurrent.futures.Future[SaveResult] | None:
        """Start one part's save (its slots back when it is done); the objects are the client's
        from here on (this adapter drops its references)."""
        objects, part.objects = part.objects, []
        future = self.client.save_async(
            tokens[: part.end_chunk * self.tpc], objects, first_chunk=part.first_chunk, trace_id=trace_id
        )
        if isinstance(self._save_slots, SaveSlots):
            self._save_slots.give_back_when_done(future, part.taken)
        part.taken = []
        return future

    def _part_ended(
        self,
        tokens: list[int],
        parts: list[_SavePart],
        index: int,
        done: concurrent.futures.Future[SaveResult],
        chained: concurrent.futures.Future[SaveResult],
        trace_id: str | None,
    ) -> None:
        """Part `index` of a prefix's save ended (on the client's loop thread): the next part
        starts, or the chain ends (`save_prefix`) and `chained` gets the whole prefix's result
        (or the exception a part ended with: the client closing cancelled it)."""
        try:
            exc = concurrent.futures.CancelledError() if done.cancelled() else done.exception()
            if exc is not None:
                self._drop_parts(parts[index + 1 :], CAUSE_DROPPED)
                chained.set_exception(exc)
                return
            result = parts[index].result = done.result()
            missing = {cause: n for cause, n in result.causes.items() if cause != IN_FLIGHT}
            cut = max(missing, key=missing.__getitem__) if result.chunks_failed and missing else None
            following = index + 1
            counted = 0  # of the parts not sent: the first ones the client counted itself
            if cut is None and following < len(parts):
                try:
                    started = self._save_part(tokens, parts[following], trace_id)
                except Exception as error:  # (the client's loop closed under the chain)
                    log.warning("kvfabric: save raised %r: the rest of the prompt not saved", error)
                    started = None
                else:
                    counted = 1 if started is None else 0  # (off: `closed` / `starting`)
                if started is not None:
                    started.add_done_callback(
                        lambda next_done: self._part_ended(
                            tokens, parts, following, next_done, chained, trace_id
                        )
                    )
                    return
                cut = CAUSE_DROPPED  # not started: counted with the parts after it (once)
            if cut is not None:
                self._drop_parts(parts[following:], cut, counted=counted)
            chained.set_result(_sum_results([part.result for part in parts if part.result is not None]))
        except BaseException as exc:  # a bug: the holder gets it, never a future left pending
            self._give_back(parts)  # (the parts not sent: a sent one's slots are the client's)
            if not chained.done():
                chained.set_exception(exc)
            raise

    def _drop_parts(self, parts: list[_SavePart], cause: str, *, counted: int = 0) -> None:
        """Parts of a prefix's save not sent (behind a chunk not stored): slots back, each part
        counted as a save dropped (but the first `counted`: the client dropped those itself and
        counted them; review, stop 71), its chunks failed under `cause`."""
        self._give_back(parts)
        for number, part in enumerate(parts):
            if number >= counted:
                self.client.metrics.saves_dropped.labels(cause).inc()
            chunks = part.end_chunk - part.first_chunk
            part.result = SaveResult(chunks_failed=chunks, causes={cause: chunks})

    def _give_back(self, parts: list[_SavePart]) -> None:
        for part in parts:
            if isinstance(self._save_slots, SaveSlots):
                self._save_slots.give_back(part.taken)
            part.taken, part.objects = [], []

    # ---- generation ------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, token_ids: Sequence[int], *, max_new_tokens: int, save: bool = True, use_cache: bool = True
    ) -> GenerateResult:
        """Greedy generation. With `use_cache`, the stored prefix is loaded and only the suffix is
        prefilled; the prompt's new full chunks are then saved (asynchronously)."""
        from transformers import DynamicCache

        ids = list(token_ids)
        started = time.perf_counter()
        trace_id = uuid.uuid4().hex  # one engine request: its lookup, load and save share it
        prefix = self.load_prefix(ids, trace_id=trace_id) if use_cache else None
        loaded = prefix.tokens if prefix else 0
        cache = prefix.cache if prefix and prefix.cache is not None else DynamicCache()
        suffix = torch.tensor([ids[loaded:]], dtype=torch.long)
        try:
            out = self.model(input_ids=suffix, past_key_values=cache, use_cache=True)
        finally:  # a forward that raises gives the lease back too (it was held to its TTL)
            if prefix is not None:
                self.client.release(prefix.hit)
        prefill_s = time.perf_counter() - started
        saving = None
        if save and use_cache:
            saving = self.save_prefix(
                ids, out.past_key_values, first_chunk=loaded // self.tpc, trace_id=trace_id
            )
        new: list[int] = []
        logits = out.logits[0, -1]
        cache = out.past_key_values
        for _ in range(max_new_tokens):
            token = int(torch.argmax(logits))
            new.append(token)
            if len(new) == max_new_tokens:
                break
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            logits, cache = out.logits[0, -1], out.past_key_values
        load_s = prefix.load_s if prefix else 0.0
        return GenerateResult(new, loaded, len(ids) - loaded, prefill_s, load_s, saving)

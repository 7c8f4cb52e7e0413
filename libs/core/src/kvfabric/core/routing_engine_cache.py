"""An engine's own prefix cache, as its KV events tell it (vLLM `--kv-events-config`).

The router's cost model needs, per instance, how many of a prompt's leading chunks the engine's
own prefix cache holds (`engine_tokens`). Without events it learns that from its own history (the
prompts whose first token came back from an instance), which never sees the engine evict. vLLM
publishes what its block pool does: `BlockStored` (block hashes, the parent block's hash, the
blocks' token ids, the block size), `BlockRemoved` (block hashes) and `AllBlocksCleared`. Its
block hashes are its own (a hash seeded per process); this map turns each stored block into the
group key the engines' kvfabric connector and the router use for the same chunk: the chain hash
of the block's tokens after its parent's (`kvfabric.format.key.chain_step`, through the
`ChunkKeyer` the shell gives), so a prompt's keys can be looked up directly.

Pure and synchronous (the router's shell feeds it from a ZMQ subscriber; `kvfabric.core.routing`
owns one per instance). State, per engine:
- `_ours`: vLLM block hash -> [group key, chain hash, physical blocks], least recently stored
  last, at most `blocks_max` (the oldest forgotten first, as if removed). vLLM can hold one hash
  in several physical blocks and stores and removes each: a hash goes when its last block does;
- `_held`: group key -> how many stored vLLM blocks map to it (two vLLM hashes of one chunk:
  vLLM hashes extra keys that ours do not).
Invariants: `_held` is exactly the count of `_ours` entries per key; no count is 0; every
physical count >= 1; `len(_ours)` <= `blocks_max`.

What it skips (counted, never guessed): a block whose parent it does not know (stored before it
started listening, or forgotten), so its chain hash cannot be computed — and every block after it
in the same event; a block of another size than a chunk, or an event whose token ids are not
exactly its blocks' (vLLM leaves a sliding window's null blocks out of the hashes, not out of the
tokens); a block stored with a
LoRA adapter or extra keys (multimodal inputs, a cache salt: the connector's keys do not cover
them). A removal of a block it does not know changes nothing. A gap in the engine's event sequence
(`clear`) forgets everything: the engine term then counts nothing until blocks are stored again
(and, since vLLM announces a block once, a prefix still resident then stays unknown, with the
blocks stored after it, until vLLM evicts and stores it again: `blocks_max` should be at least
the engine's block count, so the bound never forgets a live block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final

from kvfabric.format.invariant import invariant

__all__ = ["ENGINE_CACHE_COUNTERS", "ChunkKeyer", "EngineCache"]

# (the parent chunk's chain hash, or None for a prompt's first chunk; the chunk's tokens) ->
# (the chunk's group key, its chain hash)
ChunkKeyer = Callable[[bytes | None, Sequence[int]], tuple[bytes, bytes]]

ENGINE_CACHE_COUNTERS: Final = (
    "blocks_stored",
    "blocks_removed",
    "blocks_forgotten",
    "skipped_unknown_parent",
    "skipped_block_size",
    "skipped_extra_keys",
    "cleared",
)


class EngineCache:
    """One engine's prefix cache, from its KV events (module doc)."""

    def __init__(self, keyer: ChunkKeyer, tokens_per_chunk: int, blocks_max: int) -> None:
        invariant(tokens_per_chunk >= 1 and blocks_max >= 1, "engine cache bounds")
        self._keyer = keyer
        self._tokens_per_chunk = tokens_per_chunk
        self.blocks_max = blocks_max
        self._ours: OrderedDict[int | bytes, list[Any]] = OrderedDict()  # [key, chain, blocks]
        self._held: dict[bytes, int] = {}
        self.counters: dict[str, int] = dict.fromkeys(ENGINE_CACHE_COUNTERS, 0)

    def holds(self, key: bytes) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._ours)

    def stored(
        self,
        block_hashes: Sequence[int | bytes],
        parent: int | bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        plain: bool = True,
    ) -> int:
        """vLLM stored these blocks, in chain order, after `parent` (None: they start a prompt);
        `plain`: no LoRA and no extra keys. Returns the blocks learned."""
        n = len(block_hashes)
        if not plain:
            self.counters["skipped_extra_keys"] += n
            return 0
        if block_size != self._tokens_per_chunk or len(token_ids) != n * block_size:
            self.counters["skipped_block_size"] += n
            return 0
        if parent is None:
            prev: bytes | None = None
        else:
            known = self._ours.get(parent)
            if known is None:
                self.counters["skipped_unknown_parent"] += n
                return 0
            prev = known[1]
        keyed = []  # every key first: a keyer that raises leaves the map as it was
        for i in range(n):
            key, chain = self._keyer(prev, token_ids[i * block_size : (i + 1) * block_size])
            keyed.append((key, chain))
            prev = chain
        for block, (key, chain) in zip(block_hashes, keyed, strict=True):
            known = self._ours.get(block)
            if known is not None:  # another physical block of a hash it holds: one more, newest
                known[2] += 1
                self._ours.move_to_end(block)
                continue
            self._ours[block] = [key, chain, 1]
            self._held[key] = self._held.get(key, 0) + 1
        self.counters["blocks_stored"] += n
        while len(self._ours) > self.blocks_max:
            oldest = next(iter(self._ours))
            self._forget(oldest)
            self.counters["blocks_forgotten"] += 1
        return n

    def removed(self, block_hashes: Sequence[int | bytes]) -> int:
        """vLLM evicted these blocks (a hash goes with its last physical block). Returns how
        many it knew."""
        known = 0
        for block in block_hashes:
            entry = self._ours.get(block)
            if entry is None:
                continue
            known += 1
            entry[2] -= 1
            if not entry[2]:
                self._forget(block)
        self.counters["blocks_removed"] += known
        return known

    def clear(self) -> None:
        """All blocks cleared (vLLM's `AllBlocksCleared`), or the events cannot be trusted (a gap
        in their sequence, the engine seen down)."""
        self._ours.clear()
        self._held.clear()
        self.counters["cleared"] += 1

    def _forget(self, block: int | bytes) -> bool:
        mapped = self._ours.pop(block, None)
        if mapped is None:
            return False
        key = mapped[0]
        left = self._held[key] - 1
        if left:
            self._held[key] = left
        else:
            del self._held[key]
        return True

    def check_invariants(self) -> None:
        counts: dict[bytes, int] = {}
        for key, _, blocks in self._ours.values():
            invariant(blocks >= 1, "a held hash has a physical block")
            counts[key] = counts.get(key, 0) + 1
        invariant(counts == self._held, "held counts match the stored blocks")
        invariant(len(self._ours) <= self.blocks_max, "engine cache bounded", n=len(self._ours))

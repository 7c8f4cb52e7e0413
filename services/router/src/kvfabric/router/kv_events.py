"""An engine's KV events into the routing core: what vLLM's prefix cache stores and evicts.

vLLM with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'` publishes each scheduler step's block-pool events on a ZMQ PUB
socket: multipart `(topic, sequence number: 8 bytes big-endian, payload)`, the payload a msgpack
`KVEventBatch` — `[ts, [event, ...], data_parallel_rank]`, each event a map tagged by `type`:
`BlockStored` (`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`,
`lora_name`, `extra_keys`, `group_idx`, ...), `BlockRemoved` (`block_hashes`) or
`AllBlocksCleared`. The structs below mirror that wire shape (vLLM 0.32; unknown fields are
ignored, an unknown event type is counted and skipped), so the router does not import vLLM.
Only the engine's own block pool counts: events of another medium than `GPU` (vLLM's default
pool, also on CPU backends) or another locality than `LOCAL` (an offloading connector's CPU or
storage copies of the same block hashes, a host pool) are skipped (`other_medium`), as are
blocks of another KV cache kind than full attention.

`KvEventsFollower.run` subscribes (zmq.asyncio, on the router's loop: every receive is
cancellable), decodes each batch (`decode_batch`, pure) into `EngineStored` / `EngineRemoved` /
`EngineCleared` events of the core and feeds them through the router's `CoreDriver`, yielding
the loop after each batch (ZMQ hands a backlog over without waiting: without the yield it would
be drained in one go, HTTP and health checks waiting). A batch over `BATCH_BYTES_MAX` is refused
by ZMQ itself (`MAXMSGSIZE`: the connection drops, then reconnects). Anything else that fails
(a bad endpoint, a bug) is logged and counted (`failures`), the engine's map cleared, and the
subscription made again after a backoff (`RETRY_S_MIN` doubling to `RETRY_S_MAX`): a follower
never dies silently with a map that no longer hears evictions.
A jump in the sequence (PUB/SUB drops messages when a subscriber is slow; a restarted engine
starts again) clears the engine's map (`EngineCleared`): the engine term counts nothing until
blocks are stored again, rather than trust a map that missed evictions. Counters: `batches`,
`events`, `gaps`, `undecodable`, `unknown_events`, `other_medium`, `failures`. With data
parallelism each rank publishes its own events (`data_parallel_rank`): follow one endpoint per
rank as an engine of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Final

import msgspec
import zmq
import zmq.asyncio

from kvfabric.core.routing_events import EngineCleared, EngineRemoved, EngineStored, RoutingEvent
from kvfabric.runtime.logs import get_logger

__all__ = ["BATCH_BYTES_MAX", "KvEventsFollower", "decode_batch"]

BATCH_BYTES_MAX: Final = 16 << 20  # a step's events: block hashes and token ids of what it stored
RECEIVE_HWM: Final = 1_000  # batches queued in ZMQ before it drops (a gap, detected by sequence)
RETRY_S_MIN: Final = 0.5
RETRY_S_MAX: Final = 30.0
_OWN_MEDIA: Final = (None, "GPU")
_OWN_LOCALITY: Final = (None, "LOCAL")
_OWN_KINDS: Final = (None, "full_attention")

BlockHash = int | bytes


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tagged(msgspec.Struct):
    type: str


TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]  # what a chain hash takes


class _BlockStored(msgspec.Struct):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    medium: str | None = None
    locality: str | None = None


class _BlockRemoved(msgspec.Struct):
    block_hashes: list[BlockHash]
    group_idx: int | None = None
    medium: str | None = None
    locality: str | None = None


_tagged = msgspec.msgpack.Decoder(_Tagged)
_stored = msgspec.msgpack.Decoder(_BlockStored)
_removed = msgspec.msgpack.Decoder(_BlockRemoved)
_batch = msgspec.msgpack.Decoder(_Batch)


def decode_batch(instance_id: str, payload: bytes, counters: dict[str, int]) -> list[RoutingEvent]:
    """One published batch as the core's events, in order (`counters` counts what was skipped).
    Raises `msgspec.DecodeError` for a payload that is no batch at all."""
    batch = _batch.decode(payload)
    out: list[RoutingEvent] = []
    for raw in batch.events:
        kind = _tagged.decode(raw).type
        if kind == "BlockStored":
            e = _stored.decode(raw)
            if e.medium not in _OWN_MEDIA or e.locality not in _OWN_LOCALITY:
                counters["other_medium"] = counters.get("other_medium", 0) + 1
                continue
            # Our keys cover a chunk's tokens only: a LoRA adapter, extra keys (multimodal
            # inputs, a cache salt) or another KV cache group or kind name other content.
            plain = (
                e.lora_id is None
                and e.lora_name is None
                and not any(e.extra_keys or ())
                and not e.group_idx
                and e.kv_cache_spec_kind in _OWN_KINDS
            )
            out.append(
                EngineStored(
                    instance_id, e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, plain
                )
            )
        elif kind == "BlockRemoved":
            r = _removed.decode(raw)
            if r.medium not in _OWN_MEDIA or r.locality not in _OWN_LOCALITY:
                counters["other_medium"] = counters.get("other_medium", 0) + 1
            elif not r.group_idx:
                out.append(EngineRemoved(instance_id, r.block_hashes))
        elif kind == "AllBlocksCleared":
            out.append(EngineCleared(instance_id))
        else:
            counters["unknown_events"] = counters.get("unknown_events", 0) + 1
    return out


class KvEventsFollower:
    """Subscribes to one engine's KV events and feeds them to the core (module doc)."""

    def __init__(
        self,
        instance_id: str,
        endpoint: str,
        feed: Callable[[RoutingEvent], Awaitable[object]],
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.endpoint = endpoint
        self._feed = feed
        self._context = context or zmq.asyncio.Context.instance()
        self.counters: dict[str, int] = dict.fromkeys(
            ("batches", "events", "gaps", "undecodable", "unknown_events", "other_medium", "failures"), 0
        )
        self._last_seq: int | None = None
        self._log = get_logger("kvfabric.router.kv_events")

    async def run(self) -> None:
        """Follow until cancelled; a failure is logged, counted, the map cleared, and the
        subscription made again after a backoff."""
        retry_s = RETRY_S_MIN
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.counters["failures"] += 1
                self._log.error(
                    "kv_events_failed", instance=self.instance_id, error=repr(exc), retry_s=retry_s
                )
                self._last_seq = None
                await self._feed(EngineCleared(self.instance_id))
                await asyncio.sleep(retry_s)
                retry_s = min(RETRY_S_MAX, retry_s * 2)

    async def _follow(self) -> None:
        sock = self._context.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, BATCH_BYTES_MAX)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self.endpoint)
            self._log.info("kv_events_following", instance=self.instance_id, endpoint=self.endpoint)
            while True:
                parts = await sock.recv_multipart()
                await self.receive(parts)
                await asyncio.sleep(0)  # a backlog comes without waiting: let HTTP and health in
        finally:
            sock.close(linger=0)

    async def receive(self, parts: list[bytes]) -> None:
        """One published message (`(topic, seq, payload)`)."""
        if len(parts) != 3 or len(parts[1]) != 8:
            self.counters["undecodable"] += 1
            return
        seq = int.from_bytes(parts[1], "big")
        if self._last_seq is not None and seq != self._last_seq + 1:
            self.counters["gaps"] += 1  # missed (or the engine restarted): its map is not trusted
            self._log.warning("kv_events_gap", instance=self.instance_id, last=self._last_seq, seq=seq)
            await self._feed(EngineCleared(self.instance_id))
        self._last_seq = seq
        try:
            events = decode_batch(self.instance_id, parts[2], self.counters)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.counters["undecodable"] += 1
            await self._feed(EngineCleared(self.instance_id))  # what it said is lost: no guess
            return
        self.counters["batches"] += 1
        self.counters["events"] += len(events)
        for event in events:
            await self._feed(event)

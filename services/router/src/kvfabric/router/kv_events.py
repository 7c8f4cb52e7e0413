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
blocks are stored again, rather than trust a map that missed evictions. So does a dropped
connection (the subscription's ZMQ monitor, `disconnects`): the engine may have restarted, and
its numbers alone cannot say so, so the next batch is taken as a new engine's first.

**Replay** (`replay`, vLLM's `replay_endpoint`: a ROUTER socket that sends the batches of its
buffer, the last `buffer_steps` = 10,000 by default, from a sequence number on, then an end
marker). With it the follower asks for everything buffered as soon as it has subscribed (a
router, or a follower after a failure, that starts while the engine already holds blocks: the
buffer's last run of consecutive batches is applied, and live batches it also held are skipped
until a batch after them comes, at most `DUPLICATES_S`, `duplicates`), and before it applies a
batch that does not continue the one before (`_catch_up`): after a gap, for the batches it
missed — all of them there and in order, it applies them and the map is never cleared
(`gaps_replayed`); after a gap the replay does not cover whole, or from an engine that restarted
(its sequence starts again), for everything buffered: the map cleared, then the replay's run of
consecutive batches that ends just before the live one applied (`replayed`, batches). vLLM's
ROUTER drops what its send queue (1,000 messages) cannot hold, so a replay of a large buffer can
come back with holes, or without its end marker (a round then ends after `REPLAY_SILENCE_S`
without a message): it is asked again from its first hole, round after round while each fills
that hole (`replay_rounds`, at most `REPLAY_ROUNDS_MAX`, all within `REPLAY_TIMEOUT_S`); only a
run without holes is applied, and what came before a timeout is kept. A block stored before that
run stays unknown (its children too: the core skips a store with an unknown parent): the map can
undercount what the engine holds, never count what it does not. A replay that fails (no end
within `REPLAY_TIMEOUT_S`, a reply of another shape) is counted (`replay_failures`); of a buffer
larger than `REPLAY_BATCHES_MAX` batches (vLLM's `buffer_steps` is configurable) or
`REPLAY_BYTES_MAX` bytes the newest are kept. One that got no answer at all (an endpoint down;
an end marker alone is an answer: an engine whose buffer is empty) is not tried again for
`REPLAY_SKIP_S` (`replays_skipped`), and the map is cleared as without replay. The live socket
queues meanwhile (`RECEIVE_HWM`; what it drops is the next gap); a replay's receive loop yields
to the event loop every `REPLAY_YIELD_EVERY` batches. Counters: `batches`, `events`, `gaps`, `gaps_replayed`,
`replayed`, `replay_rounds`, `replay_failures`, `replays_skipped`, `duplicates`, `disconnects`,
`undecodable`, `unknown_events`, `other_medium`, `failures`. With data parallelism each rank
publishes its own events (`data_parallel_rank`) on its own ports (vLLM adds the rank to both the
events and the replay port): follow each rank as an engine of its own."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Final

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvfabric.core.routing_events import EngineCleared, EngineRemoved, EngineStored, RoutingEvent
from kvfabric.runtime.logs import get_logger

__all__ = ["BATCH_BYTES_MAX", "KvEventsFollower", "decode_batch"]

BATCH_BYTES_MAX: Final = 16 << 20  # a step's events: block hashes and token ids of what it stored
RECEIVE_HWM: Final = 1_000  # batches queued in ZMQ before it drops (a gap, detected by sequence)
REPLAY_TIMEOUT_S: Final = 5.0  # for the whole answer, its end marker included
REPLAY_BATCHES_MAX: Final = 20_000  # kept of one replay, the newest (twice vLLM's default buffer)
# and at most this many bytes of them (the newest): 20,000 batches of up to 16 MiB from an
# unauthenticated ZMQ peer were unbounded in bytes (review, 2026-12-06)
REPLAY_BYTES_MAX: Final = 256 << 20
REPLAY_SILENCE_S: Final = 0.2  # a replay silent this long after a batch is over (end marker dropped)
REPLAY_ROUNDS_MAX: Final = 16  # asks of one replay (each from the first hole the one before left)
REPLAY_SKIP_S: Final = 30.0  # after a replay that got nothing (its endpoint down), none for this long
REPLAY_YIELD_EVERY: Final = 64  # replayed batches received between two turns of the loop
# After the first replay, a live batch at or before it is one it held, until a batch after it
# comes or this long (a backlog of live batches queued meanwhile may take seconds to drain on a
# busy loop); a restarted engine publishes from 0 again, but its connection drops first (the
# monitor) and its model takes longer than this to load.
DUPLICATES_S: Final = 10.0
RESUBSCRIBE_S: Final = 0.1  # after a dropped connection (ZMQ itself reconnects every 0.1 s)
RETRY_S_MIN: Final = 0.5
RETRY_S_MAX: Final = 30.0
_END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)  # vLLM's end of a replay
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
        replay: str = "",
    ) -> None:
        self.instance_id = instance_id
        self.endpoint = endpoint
        self.replay = replay  # the engine's replay endpoint (ROUTER), "" for none
        self._feed = feed
        self._context = context or zmq.asyncio.Context.instance()
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "batches",
                "events",
                "gaps",
                "gaps_replayed",
                "replayed",
                "replay_failures",
                "replays_skipped",
                "replay_rounds",
                "duplicates",
                "disconnects",
                "undecodable",
                "unknown_events",
                "other_medium",
                "failures",
            ),
            0,
        )
        self._last_seq: int | None = None
        self._duplicates_until = 0.0  # monotonic s: live batches the first replay held, until then
        self._replay_skip_until = 0.0  # monotonic s: after a replay that got nothing, none until then
        self._log = get_logger("kvfabric.router.kv_events")

    async def run(self) -> None:
        """Follow until cancelled; a failure is logged, counted, the map cleared, and the
        subscription made again after a backoff; a dropped connection, a new subscription (its
        socket's queue, the old connection's, dropped with it) after `RESUBSCRIBE_S`."""
        retry_s = RETRY_S_MIN
        while True:
            followed_since = time.monotonic()
            try:
                await self._follow()
                retry_s = RETRY_S_MIN  # it followed until the connection dropped
                await asyncio.sleep(RESUBSCRIBE_S)  # subscribe anew
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() - followed_since >= RETRY_S_MAX:
                    retry_s = RETRY_S_MIN  # a failure after a long follow is not one of a series
                self.counters["failures"] += 1
                self._log.error(
                    "kv_events_failed", instance=self.instance_id, error=repr(exc), retry_s=retry_s
                )
                self._last_seq = None
                try:
                    await self._feed(EngineCleared(self.instance_id))
                except asyncio.CancelledError:
                    raise
                except Exception as feed_exc:  # the core's driver: logged, the follower lives on
                    self._log.error("kv_events_clear_failed", instance=self.instance_id, error=repr(feed_exc))
                await asyncio.sleep(retry_s)
                retry_s = min(RETRY_S_MAX, retry_s * 2)

    async def _follow(self) -> None:
        sock = self._context.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            sock.setsockopt(zmq.MAXMSGSIZE, BATCH_BYTES_MAX)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(self.endpoint)
            self._log.info("kv_events_following", instance=self.instance_id, endpoint=self.endpoint)
            if self.replay:
                await self._start_from_replay()
            poller = zmq.asyncio.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll())
                # the monitor first: batches the old connection left queued are not applied
                if monitor in ready and await _disconnected_since(monitor):
                    await self.connection_lost()
                    return
                if sock in ready:
                    await self.receive(await sock.recv_multipart())
                    await asyncio.sleep(0)  # a backlog comes without waiting: let HTTP and health in
        finally:
            if monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)

    async def connection_lost(self) -> None:
        """The subscription's connection dropped: the engine may have died or restarted, and its
        sequence alone cannot say so (a restarted engine's first batch heard may be any number),
        so the map is cleared at once and what follows is taken as from a new engine, on a new
        subscription (`run`): the next batch a first one (with replay: the buffer before it
        replayed)."""
        self.counters["disconnects"] += 1
        self._last_seq = None
        self._duplicates_until = 0.0
        await self._feed(EngineCleared(self.instance_id))

    async def receive(self, parts: list[bytes]) -> None:
        """One published message (`(topic, seq, payload)`)."""
        if len(parts) != 3 or len(parts[1]) != 8:
            self.counters["undecodable"] += 1
            return
        seq = int.from_bytes(parts[1], "big")
        last = self._last_seq
        if last is not None and seq <= last and time.monotonic() < self._duplicates_until:
            self.counters["duplicates"] += 1  # the first replay applied it already
            return
        self._duplicates_until = 0.0  # past what the replay held: a lower number is a new engine
        if last is not None and seq != last + 1:
            self.counters["gaps"] += 1  # missed (or the engine restarted): its map is not trusted
            self._log.warning("kv_events_gap", instance=self.instance_id, last=last, seq=seq)
        if self.replay and (last is None or seq != last + 1):
            await self._catch_up(last, seq)
        elif last is not None and seq != last + 1:
            await self._feed(EngineCleared(self.instance_id))
        self._last_seq = seq
        await self._apply(parts[2])

    async def _apply(self, payload: bytes) -> None:
        try:
            events = decode_batch(self.instance_id, payload, self.counters)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.counters["undecodable"] += 1
            await self._feed(EngineCleared(self.instance_id))  # what it said is lost: no guess
            return
        self.counters["batches"] += 1
        self.counters["events"] += len(events)
        for event in events:
            await self._feed(event)

    async def _catch_up(self, last: int | None, seq: int) -> None:
        """Before batch `seq`, whose predecessor was not `last`: the batches in between from the
        replay socket, or (they are not all there, or there was none before) a cleared map and
        the buffer's run of batches that ends just before `seq` (module doc)."""
        resume = last is not None and seq > last + 1
        start = last + 1 if resume and last is not None else 0
        if seq <= start:  # the first batch the engine published: nothing before it
            if last is not None:
                await self._feed(EngineCleared(self.instance_id))
            return
        run = _run_ending(await self._replay_from(start, stop_at=seq), seq - 1)
        if resume and run and run[0][0] == start:
            self.counters["gaps_replayed"] += 1
        else:
            await self._feed(EngineCleared(self.instance_id))
        await self._apply_run(run)

    async def _start_from_replay(self) -> None:
        """Just subscribed (the map is empty): the buffer's last run of consecutive batches."""
        replayed = await self._replay_from(0)
        run = _run_ending(replayed, replayed[-1][0]) if replayed else []
        await self._apply_run(run)
        if run:
            self._last_seq = run[-1][0]
            self._duplicates_until = time.monotonic() + DUPLICATES_S

    async def _apply_run(self, run: list[tuple[int, bytes]]) -> None:
        for _seq, payload in run:
            self.counters["replayed"] += 1
            await self._apply(payload)
            await asyncio.sleep(0)  # up to a buffer's worth: let HTTP and health in

    async def _replay_from(self, start: int, stop_at: int | None = None) -> list[tuple[int, bytes]]:
        """The engine's buffered batches from `start` on (up to `stop_at`, the live batch, when
        given), ascending, as received. vLLM's ROUTER drops what its send queue (1,000 messages)
        cannot hold, so a replay can come back with holes, or without its end marker: it is
        asked again from its first hole, up to `REPLAY_ROUNDS_MAX` rounds within
        `REPLAY_TIMEOUT_S` in all, while each round fills that hole (one that does not: the
        buffer moved on); with `stop_at`, every number before it was published, so a tail
        dropped up to it (the end marker too) is a hole too. What came before a timeout is kept
        (every batch received is the engine's). [] for a reply of another shape; a replay that
        got no answer at all is not tried again for `REPLAY_SKIP_S` (an endpoint that is down
        does not hold every gap for `REPLAY_TIMEOUT_S`; an end marker alone, an empty buffer,
        is an answer). Counted, logged."""
        if time.monotonic() < self._replay_skip_until:
            self.counters["replays_skipped"] += 1
            return []
        received: dict[int, bytes] = {}
        heard = False  # any answer at all, an end marker alone (an empty buffer) included
        deadline = time.monotonic() + REPLAY_TIMEOUT_S
        ask = start
        for _round in range(REPLAY_ROUNDS_MAX):
            out = _Answer()
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(self._request_replay(ask, stop_at, out), left)
                done = False
            except (TimeoutError, ValueError, zmq.ZMQError) as exc:
                self.counters["replay_failures"] += 1
                self._log.warning(
                    "kv_events_replay_failed",
                    instance=self.instance_id,
                    error=repr(exc),
                    received=len(out.batches),
                )
                if isinstance(exc, ValueError):
                    received.clear()
                    out.batches.clear()
                    out.bytes = 0
                done = True
            heard = heard or out.heard
            for seq, payload in out.batches:
                received.setdefault(seq, payload)
            _keep_newest(received)
            if done or not out.batches:
                break
            if ask not in received:
                if _round:
                    break  # the hole asked for is gone from the buffer
                ask = min(received)  # the buffer begins after `start`: its holes from its first
            # Everything before the live batch was published: a tail dropped up to it (the end
            # marker with it: it did not come) is a hole too.
            top = max(received)
            if stop_at is not None:
                top = min(top, stop_at - 1) if out.ended else stop_at - 1
            hole = next((q for q in range(ask, top + 1) if q not in received), None)
            if hole is None:
                break
            self.counters["replay_rounds"] += 1
            ask = hole
        if not heard:  # no answer at all (an endpoint down): not an engine with an empty buffer
            self._replay_skip_until = time.monotonic() + REPLAY_SKIP_S
        return sorted(received.items())

    async def _request_replay(self, start: int, stop_at: int | None, out: _Answer) -> None:
        """vLLM's replay into `out`: `("", start)` to its ROUTER; `("", topic, seq, payload)` per
        buffered batch from `start` on, then `("", "", -1, "")`; done at the end marker, at a
        batch at or past `stop_at`, or after `REPLAY_SILENCE_S` without a message once one came
        (the end marker is the last message into a full send queue: the likeliest dropped). Of
        a buffer larger than `REPLAY_BATCHES_MAX` (vLLM's `buffer_steps` is configurable), the
        newest batches are kept: the run the live batch continues is at its end."""
        sock = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)  # take all it sends: the ROUTER drops past its own queue
            sock.setsockopt(zmq.MAXMSGSIZE, BATCH_BYTES_MAX)
            sock.connect(self.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if out.heard:
                    try:
                        parts = await asyncio.wait_for(sock.recv_multipart(), REPLAY_SILENCE_S)
                    except TimeoutError:
                        return  # silent after its batches: the end marker was dropped
                else:
                    parts = await sock.recv_multipart()
                if len(parts) != 4 or len(parts[2]) != 8:
                    raise ValueError(f"a replay reply of {len(parts)} parts")
                out.heard = True
                if parts[2] == _END_SEQ:
                    out.ended = True
                    return
                seq = int.from_bytes(parts[2], "big")
                out.add(seq, parts[3])  # the oldest go past REPLAY_BATCHES_MAX / REPLAY_BYTES_MAX
                out.received += 1
                if stop_at is not None and seq >= stop_at:
                    return  # what the live batch needs is here (or was dropped)
                if out.received % REPLAY_YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # a ready receive does not yield: let HTTP and health in
        finally:
            sock.close(linger=0)


class _Answer:
    """One replay request's answer so far: its batches (the newest `REPLAY_BATCHES_MAX`, of at
    most `REPLAY_BYTES_MAX`), how many came, whether anything came (the end marker alone is an
    answer: an empty buffer), and whether its end marker did."""

    __slots__ = ("batches", "bytes", "ended", "heard", "received")

    def __init__(self) -> None:
        self.batches: collections.deque[tuple[int, bytes]] = collections.deque()
        self.bytes = 0  # of `batches`' payloads
        self.heard = False
        self.ended = False
        self.received = 0

    def add(self, seq: int, payload: bytes) -> None:
        self.batches.append((seq, payload))
        self.bytes += len(payload)
        while len(self.batches) > REPLAY_BATCHES_MAX or self.bytes > REPLAY_BYTES_MAX:
            self.bytes -= len(self.batches.popleft()[1])


def _keep_newest(received: dict[int, bytes]) -> None:
    """Drop the oldest of a replay's batches past `REPLAY_BATCHES_MAX` or `REPLAY_BYTES_MAX`
    (the newest are kept: the run before the live batch)."""
    size = sum(len(p) for p in received.values())
    if len(received) <= REPLAY_BATCHES_MAX and size <= REPLAY_BYTES_MAX:
        return
    for seq in sorted(received):
        if len(received) <= REPLAY_BATCHES_MAX and size <= REPLAY_BYTES_MAX:
            break
        size -= len(received.pop(seq))


def _run_ending(replayed: list[tuple[int, bytes]], end: int) -> list[tuple[int, bytes]]:
    """The longest run of consecutive sequence numbers in `replayed` (ascending, as vLLM sends
    its buffer) that ends at `end` (empty when `end` is not there): what can be applied in
    order before the batch after `end`."""
    before = [(s, p) for s, p in replayed if s <= end]
    if not before or before[-1][0] != end:
        return []
    i = len(before) - 1
    while i > 0 and before[i - 1][0] == before[i][0] - 1:
        i -= 1
    return before[i:]


async def _disconnected_since(monitor: zmq.asyncio.Socket) -> bool:
    """Whether the subscription's monitor told of a dropped connection since it was last asked
    (a disconnect is told before the connection made again delivers anything)."""
    lost = False
    while True:
        try:
            message = await monitor.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return lost
        lost = lost or parse_monitor_message(message)["event"] == zmq.EVENT_DISCONNECTED

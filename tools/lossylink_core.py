"""The lossy link's schedule: the pure core of tools/lossylink.py (no I/O; time is passed in, in ms).

This kernel has no `sch_netem`, so the drills' delay and loss are applied in user space: a
forwarder process bridges TUN devices and asks this core, for every IP packet, whether it leaves
and when. One `LinkDirection` per direction of the impaired link, each with its own seeded
random stream (the same seed and the same arrivals give the same drops and delays), applies its
`LinkSchedule` in this order:

1. **loss**: independent (`loss_p` per packet) and bursty (Gilbert–Elliott: a two-state chain,
   `ge_p` = P(good -> bad) and `ge_r` = P(bad -> good) per packet, loss `ge_loss_bad_p` in the
   bad state and `ge_loss_good_p` in the good one; `bursty(loss_p, burst_packets)` builds them
   from a mean loss and a mean burst length). A packet either model drops is gone.
2. **rate cap** (`rate_bytes_per_s`, 0 = none): packets are serialised one after the other at
   that rate; one that would wait longer than `queue_ms_max` behind the others is dropped (tail
   drop), so the queue is bounded as a real link's is.
3. **delay**: `delay_ms` plus a jitter offset in [-jitter_ms, +jitter_ms] (the delay clipped at
   0). The offset wanders between random points of that range (each drawn uniformly when the
   last is reached) at `JITTER_SLEW` ms per ms of arrival time: the delay varies over time, at
   any packet rate, yet a packet never leaves before the one ahead of it (the slew is below 1;
   jitter drawn anew per packet would either reorder a dense stream or, held in order, pin it
   at the top of the range). Packets keep their order, except
4. **reordering**: with `reorder_p` a packet skips the delay (it leaves once serialised) and so
   overtakes the packets still in flight, as netem's `reorder` does;
5. **duplication**: with `duplicate_p` a second copy leaves at the same time.

States: a direction is in the good or the bad Gilbert–Elliott state; its serialiser is free from
`link_free_ms`; its last in-order packet leaves at `last_release_ms`. Invariants: release times
are never before arrival; without reordering, release times of the packets it lets through are
non-decreasing; it never holds more than `queue_ms_max` of serialisation ahead of now.

`LinkQueue` holds the packets in flight (any number of directions) ordered by release time, at
most `in_flight_packets_max` (beyond: dropped and counted); the forwarder pops what is due.
The caller owns the packet bytes it pushes; the queue hands them back once, then forgets them.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Final

__all__ = [
    "IN_FLIGHT_PACKETS_MAX",
    "DirectionStats",
    "LinkDirection",
    "LinkQueue",
    "LinkSchedule",
    "bursty",
    "expected_loss_p",
]

IN_FLIGHT_PACKETS_MAX: Final = 16_384  # at most ~24 MiB of 1500-byte packets held for their delay
JITTER_SLEW: Final = 0.5  # ms of jitter offset change per ms of arrival time (< 1: never reorders)


@dataclass(frozen=True, slots=True)
class LinkSchedule:
    """What one direction of the link does to packets (module docstring). The default is a
    perfect link: no delay, no loss, no cap."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_p: float = 0.0
    ge_p: float = 0.0  # Gilbert–Elliott P(good -> bad) per packet; 0 = the model is off
    ge_r: float = 1.0  # P(bad -> good) per packet: mean burst length 1 / ge_r packets
    ge_loss_bad_p: float = 1.0
    ge_loss_good_p: float = 0.0
    reorder_p: float = 0.0
    duplicate_p: float = 0.0
    rate_bytes_per_s: float = 0.0  # 0 = no cap
    queue_ms_max: float = 1_000.0  # rate-capped queue: a packet that would wait longer is dropped

    def __post_init__(self) -> None:
        for name in ("loss_p", "ge_p", "ge_r", "ge_loss_bad_p", "ge_loss_good_p", "reorder_p", "duplicate_p"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"link schedule {name} must be a probability in [0, 1], got {value}")
        for name in ("delay_ms", "jitter_ms", "rate_bytes_per_s", "queue_ms_max"):
            if getattr(self, name) < 0:
                raise ValueError(f"link schedule {name} must not be negative, got {getattr(self, name)}")
        if self.ge_p > 0 and self.ge_r == 0:
            raise ValueError("link schedule ge_r must be > 0 when ge_p > 0 (the bad state would never end)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkSchedule:
        """From a drill's TOML or a control message: the field names, plus `bursty = {loss_p,
        burst_packets}` for a Gilbert–Elliott model given by its mean loss and burst length."""
        d = dict(d)
        known = {f.name for f in fields(cls)}
        if "bursty" in d:
            b = d.pop("bursty")
            ge = bursty(float(b["loss_p"]), float(b["burst_packets"]))
            d.update(ge_p=ge.ge_p, ge_r=ge.ge_r)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown link schedule field(s): {', '.join(sorted(unknown))}")
        return cls(**{k: float(v) for k, v in d.items()})

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v != getattr(LinkSchedule(), k)}

    def describe(self) -> str:
        """One line for the drill table, e.g. `delay 200±20 ms, loss 5%`."""
        parts = []
        if self.delay_ms or self.jitter_ms:
            parts.append(f"delay {self.delay_ms:g}±{self.jitter_ms:g} ms")
        if self.loss_p:
            parts.append(f"loss {self.loss_p:.0%}")
        if self.ge_p:
            parts.append(f"bursty loss {expected_loss_p(self):.1%} (bursts of {1 / self.ge_r:.1f})")
        if self.reorder_p:
            parts.append(f"reorder {self.reorder_p:.0%}")
        if self.duplicate_p:
            parts.append(f"duplicate {self.duplicate_p:.0%}")
        if self.rate_bytes_per_s:
            parts.append(f"rate {self.rate_bytes_per_s * 8 / 1e6:g} Mbit/s")
        return ", ".join(parts) or "clear"


def bursty(loss_p: float, burst_packets: float) -> LinkSchedule:
    """A Gilbert model (loss 1 in the bad state, 0 in the good) with mean loss `loss_p` and mean
    burst length `burst_packets`: r = 1 / burst, and p from the stationary share of the bad
    state, p / (p + r) = loss_p."""
    if not 0.0 <= loss_p < 1.0 or burst_packets < 1.0:
        raise ValueError(
            f"bursty loss needs 0 <= loss_p < 1 and burst_packets >= 1, got {loss_p}, {burst_packets}"
        )
    r = 1.0 / burst_packets
    return LinkSchedule(ge_p=r * loss_p / (1.0 - loss_p), ge_r=r)


def expected_loss_p(s: LinkSchedule) -> float:
    """The long-run share of packets the schedule's loss models drop (not counting tail drops)."""
    ge = 0.0
    if s.ge_p > 0:
        bad = s.ge_p / (s.ge_p + s.ge_r)
        ge = bad * s.ge_loss_bad_p + (1.0 - bad) * s.ge_loss_good_p
    return 1.0 - (1.0 - s.loss_p) * (1.0 - ge)


@dataclass(slots=True)
class DirectionStats:
    offered: int = 0  # packets that arrived
    lost: int = 0  # dropped by the loss models
    queue_dropped: int = 0  # dropped by the rate cap's queue bound
    reordered: int = 0  # sent ahead of the delay
    duplicated: int = 0  # sent twice
    bytes_offered: int = 0


@dataclass(slots=True)
class LinkDirection:
    """One direction of the link (module docstring). `offer` says when each copy leaves."""

    schedule: LinkSchedule
    seed: str
    rng: random.Random = field(init=False)
    bad: bool = False
    link_free_ms: float = 0.0
    last_release_ms: float = 0.0
    jitter_offset_ms: float = 0.0
    jitter_target_ms: float = 0.0
    jitter_at_ms: float | None = None  # arrival time the offset was last moved to
    stats: DirectionStats = field(default_factory=DirectionStats)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _jitter_ms(self, now_ms: float) -> float:
        """The offset at `now_ms`, moved toward its target at JITTER_SLEW (a new target drawn
        each time one is reached; bounded: a long gap just draws a fresh offset)."""
        j = self.schedule.jitter_ms
        if self.jitter_at_ms is None or (now_ms - self.jitter_at_ms) * JITTER_SLEW > 4 * j:
            self.jitter_offset_ms = self.rng.uniform(-j, j)
            self.jitter_target_ms = self.rng.uniform(-j, j)
        else:
            step_ms = max(0.0, now_ms - self.jitter_at_ms) * JITTER_SLEW
            for _ in range(8):  # 8 legs cover more than 4 j of travel only when targets are near
                gap_ms = self.jitter_target_ms - self.jitter_offset_ms
                if abs(gap_ms) > step_ms:
                    self.jitter_offset_ms += step_ms if gap_ms > 0 else -step_ms
                    break
                self.jitter_offset_ms = self.jitter_target_ms
                step_ms -= abs(gap_ms)
                self.jitter_target_ms = self.rng.uniform(-j, j)
        self.jitter_at_ms = max(now_ms, self.jitter_at_ms or now_ms)
        return max(-j, min(j, self.jitter_offset_ms))

    def set_schedule(self, schedule: LinkSchedule) -> None:
        """Takes effect for packets arriving from now on; those in flight keep their times."""
        self.schedule = schedule
        if schedule.ge_p == 0:
            self.bad = False

    def _lost(self) -> bool:
        s = self.schedule
        lost = s.loss_p > 0 and self.rng.random() < s.loss_p
        if s.ge_p > 0:  # step the chain, then the state decides this packet
            if self.bad:
                self.bad = self.rng.random() >= s.ge_r
            else:
                self.bad = self.rng.random() < s.ge_p
            p = s.ge_loss_bad_p if self.bad else s.ge_loss_good_p
            lost = (p > 0 and self.rng.random() < p) or lost
        return lost

    def offer(self, size_bytes: int, now_ms: float) -> tuple[float, ...]:
        """A packet of `size_bytes` arrived at `now_ms`: the release times of its copies (none:
        dropped, two: duplicated)."""
        s, st = self.schedule, self.stats
        st.offered += 1
        st.bytes_offered += size_bytes
        if self._lost():
            st.lost += 1
            return ()
        depart_ms = now_ms
        if s.rate_bytes_per_s > 0:
            start_ms = max(now_ms, self.link_free_ms)
            if start_ms - now_ms > s.queue_ms_max:
                st.queue_dropped += 1
                return ()
            depart_ms = start_ms + size_bytes * 1000.0 / s.rate_bytes_per_s
            self.link_free_ms = depart_ms
        if s.reorder_p > 0 and self.rng.random() < s.reorder_p:
            st.reordered += 1
            release_ms = depart_ms  # skips the delay: overtakes what is in flight
        else:
            delay_ms = s.delay_ms
            if s.jitter_ms > 0:
                delay_ms += self._jitter_ms(now_ms)
            release_ms = max(depart_ms + max(0.0, delay_ms), self.last_release_ms)
            self.last_release_ms = release_ms
        if s.duplicate_p > 0 and self.rng.random() < s.duplicate_p:
            st.duplicated += 1
            return (release_ms, release_ms)
        return (release_ms,)


@dataclass(slots=True)
class LinkQueue:
    """Packets in flight, by release time (then arrival order). Bounded."""

    in_flight_packets_max: int = IN_FLIGHT_PACKETS_MAX
    overflow_dropped: int = 0
    _heap: list[tuple[float, int, int, bytes]] = field(default_factory=list)
    _seq: int = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, release_ms: float, port: int, packet: bytes) -> bool:
        """Hold `packet` for `port` until `release_ms`. False (dropped, counted) when full."""
        if len(self._heap) >= self.in_flight_packets_max:
            self.overflow_dropped += 1
            return False
        self._seq += 1
        heapq.heappush(self._heap, (release_ms, self._seq, port, packet))
        return True

    def next_release_ms(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_ms: float, count_max: int = 1 << 30) -> list[tuple[int, bytes]]:
        """The packets due at `now_ms` (at most `count_max`), in release order: (port, packet)."""
        out: list[tuple[int, bytes]] = []
        while self._heap and self._heap[0][0] <= now_ms and len(out) < count_max:
            _, _, port, packet = heapq.heappop(self._heap)
            out.append((port, packet))
        return out

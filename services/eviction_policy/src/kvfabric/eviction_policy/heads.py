"""Which ancestors of a batch's demoted tails are on no disk, and what each tail waits for: pure
functions the shell's `_heads_on_disk` uses (docs/ssd-tier.md, "Whole prefixes on disk").

A tail goes to disk only with its whole prefix there, so before a batch is demoted every ancestor
of a victim that is held, not on any disk whole, and not itself evicting is copied to disk
(`keep_arena`). The walk stops at the first ancestor the records do not hold.

Linear in the prefixes walked, not in victims × depth: each ancestor is walked once for the
whole batch (`heads_off_disk` remembers, per chain walked, its nearest such ancestor above it),
and each tail's verdict is read off a chain of links resolved once (`HeadsOffDisk.verdicts`).
Listed per victim instead, a batch of 1,024 tails under a 2,048-chunk prefix named ~10⁶
(ancestor, tail) pairs and held the event loop 1.25 s (review, stop 65).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["HEAD_NOT_COPIED", "HEAD_ON_DISK", "HeadsOffDisk", "Verdict", "heads_off_disk", "with_ancestor_in"]

# A head's copy outcome after which its tails may be demoted: it is on disk now.
HEAD_ON_DISK: Final = frozenset({"copied", "on_disk"})
# The outcomes after which its tails are demoted anyway, counted `head_not_copied`: that disk
# cannot hold it, or no one segment can copy it whole (a copy per member's segment is not built),
# or the directory has no such group ("gone").
HEAD_NOT_COPIED: Final = frozenset({"no_disk", "no_capacity", "spread", "gone"})

Verdict = Literal["ok", "not_copied", "waits"]
_RANK: Final[dict[Verdict, int]] = {"ok": 0, "not_copied": 1, "waits": 2}
_BY_RANK: Final[tuple[Verdict, ...]] = ("ok", "not_copied", "waits")


@dataclass(frozen=True, slots=True)
class HeadsOffDisk:
    """The ancestors to copy, and for each victim its nearest one, linked up the prefix."""

    needed: list[bytes]  # each ancestor to copy, once: victims' order, nearest first
    nearest: dict[bytes, bytes]  # victim -> its nearest ancestor in `needed` (none: not listed)
    next_up: dict[bytes, bytes | None]  # ancestor in `needed` -> the next one above it

    def verdicts(self, outcome: Mapping[bytes, str]) -> dict[bytes, Verdict]:
        """Each victim with an ancestor to copy -> "waits" when any of its ancestors' copies
        failed (anything but `HEAD_ON_DISK` or `HEAD_NOT_COPIED`), else "not_copied" when any
        could not be copied, else "ok". `outcome` names every ancestor in `needed`."""
        rank: dict[bytes, int] = {}  # ancestor -> the worst outcome from it up
        for ancestor in self.needed:
            walk: list[bytes] = []
            at: bytes | None = ancestor
            while at is not None and at not in rank:
                walk.append(at)
                at = self.next_up[at]  # acyclic: a link points to a chain linked before it
            worst = rank[at] if at is not None else 0
            for node in reversed(walk):
                worst = max(worst, _RANK[_verdict_of(outcome[node])])
                rank[node] = worst
        return {victim: _BY_RANK[rank[ancestor]] for victim, ancestor in self.nearest.items()}


def _verdict_of(result: str) -> Verdict:
    if result in HEAD_ON_DISK:
        return "ok"
    return "not_copied" if result in HEAD_NOT_COPIED else "waits"


def heads_off_disk(
    victims: Sequence[bytes],
    parent: Mapping[bytes, bytes],
    held: Callable[[bytes], bool],
    to_copy: Callable[[bytes], bool],
) -> HeadsOffDisk:
    """The ancestors of `victims` (evicting chains) to copy to disk: walking up from each, while
    `held`, those `to_copy` (not whole on a disk, not evicting). Each chain is walked once over
    the whole batch; a walk stops at a repeat (a cycle of chain hashes cannot be made: on one,
    the walk ends, but a victim on the cycle may then list fewer ancestors than a walk of its
    own would)."""
    needed: list[bytes] = []
    is_needed: set[bytes] = set()
    above: dict[bytes, bytes | None] = {}  # chain walked -> its nearest ancestor in `needed`
    for victim in victims:
        if victim in above:  # an ancestor of a victim before it: walked already
            continue
        walk = [victim]
        on_walk = {victim}
        at = parent.get(victim)
        top: bytes | None = None  # the nearest needed ancestor above the walk's last chain
        while at is not None and at not in on_walk and held(at):
            if at in above:
                top = at if at in is_needed else above[at]
                break
            if to_copy(at):
                needed.append(at)
                is_needed.add(at)
            walk.append(at)
            on_walk.add(at)
            at = parent.get(at)
        for node in reversed(walk):
            above[node] = top
            if node in is_needed:
                top = node
    nearest = {v: a for v in dict.fromkeys(victims) if (a := above.get(v)) is not None}
    return HeadsOffDisk(needed, nearest, {a: above[a] for a in needed})


def with_ancestor_in(chains: Sequence[bytes], parent: Mapping[bytes, bytes], among: set[bytes]) -> set[bytes]:
    """The chains of `chains` with an ancestor, however far up, in `among`; each chain walked
    once for all of them (a walk per chain to its root was O(chains × depth): a disk pool's
    batch of copied heads under one deep prefix). A walk stops at a repeat."""
    below: dict[bytes, bool] = {}  # chain walked -> an ancestor of it is in `among`
    for chain in chains:
        walk: list[bytes] = []
        on_walk: set[bytes] = set()
        at: bytes | None = chain
        while at is not None and at not in below and at not in on_walk:
            walk.append(at)
            on_walk.add(at)
            at = parent.get(at)
        found = at is not None and at in below and (below[at] or at in among)
        for node in reversed(walk):
            below[node] = found
            found = found or node in among
    return {c for c in chains if below[c]}

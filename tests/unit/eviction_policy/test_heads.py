"""`heads.heads_off_disk`: the ancestors of a batch's tails to copy to disk first, walked once for
the whole batch, and each tail's verdict from their copies (issue 23, whole prefixes on disk)."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import given
from hypothesis import strategies as st

from kvfabric.eviction_policy.heads import (
    HEAD_NOT_COPIED,
    HEAD_ON_DISK,
    Verdict,
    heads_off_disk,
    with_ancestor_in,
)

OUTCOMES = sorted(HEAD_ON_DISK | HEAD_NOT_COPIED | {"failed", "error_timeout"})


class CountingParents(dict[bytes, bytes]):
    """A parent map that counts its look-ups: the walk's cost."""

    looked_up = 0

    def get(self, key: bytes, default: bytes | None = None) -> bytes | None:  # type: ignore[override]
        self.looked_up += 1
        return super().get(key, default)


def test_a_batch_of_tails_under_a_deep_prefix_walks_each_chain_once() -> None:
    """1,024 tails branching off a 2,048-chunk prefix on no disk (conversations under one long
    shared prompt): each chain is looked up a bounded number of times (a walk per tail to the
    root made ~2·10⁶ look-ups: 1.25 s on the loop, review stop 65), and each tail waits for, or
    follows, every head above it."""
    depth, branches = 2048, 1024
    trunk = [b"t%d" % i for i in range(depth)]
    tails = [b"b%d" % i for i in range(branches)]
    parent = CountingParents({trunk[i]: trunk[i - 1] for i in range(1, depth)})
    parent.update(dict.fromkeys(tails, trunk[-1]))
    heads = heads_off_disk(tails, parent, lambda c: True, lambda c: c.startswith(b"t"))
    assert heads.needed == trunk[::-1]  # nearest first
    assert parent.looked_up <= 2 * (depth + branches)
    assert heads.nearest == dict.fromkeys(tails, trunk[-1])
    copied = dict.fromkeys(heads.needed, "copied")
    assert heads.verdicts(copied) == dict.fromkeys(tails, "ok")
    assert heads.verdicts(copied | {trunk[0]: "failed"}) == dict.fromkeys(tails, "waits")  # the root
    assert heads.verdicts(copied | {trunk[5]: "spread"}) == dict.fromkeys(tails, "not_copied")


def test_the_walk_stops_at_a_chain_not_held_and_at_a_cycle() -> None:
    parent = {b"c": b"b", b"b": b"a", b"a": b"root", b"p": b"q", b"q": b"p"}
    heads = heads_off_disk([b"c", b"p"], parent, lambda c: c != b"a", lambda c: True)
    assert heads.needed == [b"b", b"q"]  # not a (not held), nor anything above it
    assert heads.nearest == {b"c": b"b", b"p": b"q"} and heads.next_up == {b"b": None, b"q": None}
    assert heads_off_disk([], parent, lambda c: True, lambda c: True).needed == []


def _ancestors(chain: bytes, parent: dict[bytes, bytes]) -> Iterator[bytes]:
    seen = {chain}
    at = parent.get(chain)
    while at is not None and at not in seen:
        yield at
        seen.add(at)
        at = parent.get(at)


@st.composite
def batches(
    draw: st.DrawFn,
) -> tuple[list[bytes], dict[bytes, bytes], set[bytes], set[bytes], dict[bytes, str]]:
    n = draw(st.integers(1, 30))
    names = [b"%d" % i for i in range(n)]
    parent = {names[i]: names[draw(st.integers(0, i - 1))] for i in range(1, n) if draw(st.booleans())}
    victims = draw(st.lists(st.sampled_from(names), unique=True, min_size=1))
    held = set(draw(st.lists(st.sampled_from(names)))) | set(victims)
    to_copy = set(draw(st.lists(st.sampled_from(names)))) - set(victims)  # victims are evicting
    outcome = {name: draw(st.sampled_from(OUTCOMES)) for name in names}
    return victims, parent, held, to_copy, outcome


@given(batches())
def test_it_finds_what_a_walk_per_victim_finds(
    case: tuple[list[bytes], dict[bytes, bytes], set[bytes], set[bytes], dict[bytes, str]],
) -> None:
    """Against the walk it replaced: every victim's ancestors up to the first not held, those to
    copy listed once in the order first reached, and each victim's verdict the worst of its
    own ancestors' outcomes."""
    victims, parent, held, to_copy, outcome = case
    model: dict[bytes, list[bytes]] = {}  # ancestor -> the victims below it
    for victim in victims:
        for ancestor in _ancestors(victim, parent):
            if ancestor not in held:
                break
            if ancestor in to_copy:
                model.setdefault(ancestor, []).append(victim)
    heads = heads_off_disk(victims, parent, held.__contains__, to_copy.__contains__)
    assert heads.needed == list(model)
    expected: dict[bytes, Verdict] = {}
    for ancestor, below in model.items():
        result = outcome[ancestor]
        verdict: Verdict = (
            "ok" if result in HEAD_ON_DISK else "not_copied" if result in HEAD_NOT_COPIED else "waits"
        )
        for victim in below:
            if expected.get(victim) != "waits" and (verdict != "ok" or victim not in expected):
                expected[victim] = verdict
    assert heads.verdicts({a: outcome[a] for a in heads.needed}) == expected


def test_chains_below_one_that_goes_whole_are_found_walking_each_chain_once() -> None:
    """`with_ancestor_in`: 1,024 copied heads branching off a 2,048-chunk prefix, one trunk chunk
    going whole: every branch is below it, found in a bounded number of look-ups."""
    depth, branches = 2048, 1024
    trunk = [b"t%d" % i for i in range(depth)]
    tails = [b"b%d" % i for i in range(branches)]
    parent = CountingParents({trunk[i]: trunk[i - 1] for i in range(1, depth)})
    parent.update(dict.fromkeys(tails, trunk[-1]))
    assert with_ancestor_in(tails, parent, {trunk[3]}) == set(tails)
    assert parent.looked_up <= 2 * (depth + branches)
    assert with_ancestor_in(tails + trunk[:3], parent, {trunk[3]}) == set(tails)
    assert with_ancestor_in(tails, parent, {b"elsewhere"}) == set()


@given(batches())
def test_with_ancestor_in_finds_what_a_walk_per_chain_finds(
    case: tuple[list[bytes], dict[bytes, bytes], set[bytes], set[bytes], dict[bytes, str]],
) -> None:
    chains, parent, among, _, _ = case
    expected = {c for c in chains if any(a in among for a in _ancestors(c, parent))}
    assert with_ancestor_in(chains, parent, among) == expected

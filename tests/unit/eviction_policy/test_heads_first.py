"""`tiers.heads_first`: a batch's victims reordered so that a head is demoted no later than its
tails (issue 23, whole prefixes on disk)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfabric.eviction_policy.tiers import heads_first


def test_a_chain_given_tails_first_comes_out_heads_first() -> None:
    parent = {b"b": b"a", b"c": b"b", b"y": b"x"}
    assert heads_first([b"c", b"y", b"b", b"a", b"x"], parent) == [b"a", b"x", b"y", b"b", b"c"]


def test_ancestors_outside_the_batch_and_cycles_do_not_matter() -> None:
    parent = {b"b": b"a", b"c": b"b", b"p": b"q", b"q": b"p"}
    assert heads_first([b"c", b"b"], parent) == [b"b", b"c"]  # a is not a victim
    assert sorted(heads_first([b"p", b"q"], parent)) == [b"p", b"q"]  # ends; each once
    assert heads_first([b"b", b"b"], parent) == [b"b"]


@st.composite
def forests(draw: st.DrawFn) -> tuple[list[bytes], dict[bytes, bytes]]:
    n = draw(st.integers(1, 30))
    names = [b"%d" % i for i in range(n)]
    parent = {names[i]: names[draw(st.integers(0, i - 1))] for i in range(1, n) if draw(st.booleans())}
    chosen = draw(st.lists(st.sampled_from(names), unique=True, min_size=1))
    return chosen, parent


@given(forests())
def test_every_victim_comes_after_its_ancestors_among_them(
    case: tuple[list[bytes], dict[bytes, bytes]],
) -> None:
    chains, parent = case
    ordered = heads_first(chains, parent)
    assert sorted(ordered) == sorted(chains)
    position = {c: i for i, c in enumerate(ordered)}
    for chain in chains:
        at = parent.get(chain)
        while at is not None:
            if at in position:
                assert position[at] < position[chain]
            at = parent.get(at)

"""The shard map a `DirectoryRouter` assembles from instances' parts (`merge_map`, pure).

A model of the cluster: each shard has a sequence of terms (instance, epoch) with strictly
increasing epochs (the leadership core guarantees it); at any moment an instance may still
claim a term that has ended (it has not noticed yet) and a new leader may not have answered.
Whatever parts arrive, the map names at most one leader per shard, that leader is the newest
claim received, and the epochs a router knows never go backwards across refreshes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfabric.cluster.directory_router import merge_map
from kvfabric.proto import directory as m

SHARDS = 4
INSTANCES = ("a", "b", "c")

terms = st.lists(st.sampled_from(INSTANCES), min_size=1, max_size=4)  # successive leaders of a shard


@st.composite
def cluster_views(draw: st.DrawFn) -> list[list[m.ShardMapReply]]:
    """Successive refreshes: each a set of parts, every claim a real (possibly ended) term."""
    history = {s: draw(terms) for s in range(SHARDS)}  # term i of shard s has epoch 10*i + s + 1
    refreshes = []
    for _ in range(draw(st.integers(1, 4))):
        claims: dict[str, list[m.ShardLeader]] = {i: [] for i in INSTANCES}
        for shard, leaders in history.items():
            for index in draw(st.sets(st.integers(0, len(leaders) - 1))):
                claims[leaders[index]].append(m.ShardLeader(shard, leaders[index], 10 * index + shard + 1))
        answering = draw(st.sets(st.sampled_from(INSTANCES)))
        wrong_count = draw(st.booleans())  # a misconfigured instance: ignored
        parts = [m.ShardMapReply(shards=SHARDS, instance=i, leaders=claims[i]) for i in sorted(answering)]
        if wrong_count:
            parts.append(
                m.ShardMapReply(shards=SHARDS + 1, instance="x", leaders=[m.ShardLeader(0, "x", 999)])
            )
        refreshes.append(parts)
    return refreshes


@given(cluster_views())
def test_one_leader_per_shard_the_newest_claim_and_epochs_never_go_back(
    refreshes: list[list[m.ShardMapReply]],
) -> None:
    known: dict[int, int] = {}
    for parts in refreshes:
        routes = merge_map(parts, SHARDS, known)
        claims = [
            (leader.shard, leader.epoch, leader.instance)
            for p in parts
            if p.shards == SHARDS
            for leader in p.leaders
        ]
        for shard in range(SHARDS):
            mine = [c for c in claims if c[0] == shard]
            newest = max(mine, default=None, key=lambda c: c[1])
            if newest is None or newest[1] < known.get(shard, 0):
                assert shard not in routes  # nothing claimed, or only deposed leaders answered
            else:
                assert (routes[shard].instance, routes[shard].epoch) == (newest[2], newest[1])
        assert all(0 <= s < SHARDS for s in routes) and "x" not in {r.instance for r in routes.values()}
        for shard, route in routes.items():
            assert route.epoch >= known.get(shard, 0)
            known[shard] = route.epoch

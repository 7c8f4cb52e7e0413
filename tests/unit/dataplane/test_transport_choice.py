"""`pick_transport`: the stream transport unless a measured table says UCX is faster for that peer
and size (docs/ucx.md)."""

from __future__ import annotations

import pytest

from kvfabric.dataplane.addresses import ANY_PEER, UCX_GAIN_MIN, TransportTable, pick_transport
from kvfabric.format.errors import BadRequest

KiB = 1 << 10
MiB = 1 << 20
BOTH = "tcp://10.0.0.5:7100 ucx://10.0.0.5:7101"
TCP, UCX = "tcp://10.0.0.5:7100", "ucx://10.0.0.5:7101"


def table(*rows: tuple[str, str, int, float]) -> TransportTable:
    return TransportTable.from_points(rows)


# UCX slower at 256 KiB, faster at 1 MiB and 16 MiB (for every peer)
MIXED = table(
    (ANY_PEER, "tcp", 256 * KiB, 2.0),
    (ANY_PEER, "ucx", 256 * KiB, 1.0),
    (ANY_PEER, "tcp", 1 * MiB, 2.0),
    (ANY_PEER, "ucx", 1 * MiB, 3.0),
    (ANY_PEER, "tcp", 16 * MiB, 2.0),
    (ANY_PEER, "ucx", 16 * MiB, 3.0),
)


def test_without_a_measurement_the_stream_transport_is_chosen() -> None:
    assert pick_transport(BOTH, 1 * MiB) == TCP
    assert pick_transport(BOTH, 1 * MiB, TransportTable()) == TCP
    assert pick_transport(BOTH, 1 * MiB, table((ANY_PEER, "ucx", MiB, 9.0))) == TCP  # no tcp figure


@pytest.mark.parametrize(
    ("size", "chosen"),
    [
        (256 * KiB, TCP),  # UCX measured slower
        (1 * MiB, UCX),
        (600 * KiB, UCX),  # nearer 1 MiB than 256 KiB (log scale)
        (400 * KiB, TCP),  # nearer 256 KiB
        (512 * KiB, TCP),  # halfway: the smaller size decides
        (1, TCP),  # below the smallest measured size: the smallest
        (1 << 30, UCX),  # above the largest: the largest
    ],
)
def test_ucx_is_chosen_only_where_measured_faster(size: int, chosen: str) -> None:
    assert pick_transport(BOTH, size, MIXED) == chosen


def test_ucx_must_beat_the_stream_transport_by_the_margin() -> None:
    at_margin = table((ANY_PEER, "tcp", MiB, 2.0), (ANY_PEER, "ucx", MiB, 2.0 * UCX_GAIN_MIN))
    below = table((ANY_PEER, "tcp", MiB, 2.0), (ANY_PEER, "ucx", MiB, 2.0 * UCX_GAIN_MIN * 0.99))
    assert pick_transport(BOTH, MiB, at_margin) == UCX
    assert pick_transport(BOTH, MiB, below) == TCP


def test_a_segment_that_requires_tls_or_has_no_ucx_gets_the_stream_transport() -> None:
    assert pick_transport("tls://10.0.0.5:7100 ucx://10.0.0.5:7101", MiB, MIXED) == "tls://10.0.0.5:7100"
    assert pick_transport(TCP, MiB, MIXED) == TCP
    with pytest.raises(BadRequest):
        pick_transport(UCX, MiB, MIXED)  # no stream transport at all: as pick_stream


def test_a_peers_own_rows_win_over_any_peer() -> None:
    rows = [*MIXED.gbps.items()]
    own = table(
        *((h, s, n, g) for (h, s, n), g in rows),
        ("10.0.0.5", "tcp", MiB, 4.0),
        ("10.0.0.5", "ucx", MiB, 3.0),
        ("10.0.0.9", "tcp", MiB, 4.0),  # only one scheme measured for this peer: ANY_PEER applies
    )
    assert pick_transport(BOTH, MiB, own) == TCP
    assert pick_transport("tcp://10.0.0.9:7100 ucx://10.0.0.9:7101", MiB, own) == "ucx://10.0.0.9:7101"


def test_only_sizes_measured_for_both_transports_are_compared() -> None:
    apart = table((ANY_PEER, "tcp", MiB, 2.0), (ANY_PEER, "ucx", 4 * MiB, 9.0))
    assert apart.compare("10.0.0.5", "tcp", "ucx", MiB) is None
    assert pick_transport(BOTH, 4 * MiB, apart) == TCP


@pytest.mark.parametrize(
    "bad", [("*", "tcp", 0, 1.0), ("*", "tcp", MiB, 0.0), ("*", "tcp", MiB, float("nan"))]
)
def test_unusable_measurements_are_refused(bad: tuple[str, str, int, float]) -> None:
    with pytest.raises(BadRequest):
        TransportTable.from_points([bad])

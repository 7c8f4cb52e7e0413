"""The directory instance's admission filter feed (issue 25 item 4): a published filter goes into
every shard core led here, a malformed or oversized one into none, and the metrics show its age."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfabric.core.directory import DirectoryConfig, DirectoryCore
from kvfabric.directory.admission_filter import (
    ADMISSION_FILTER_SUBJECT,
    AdmissionFilterCollector,
    AdmissionFilterFeed,
)
from kvfabric.directory.settings import load_directory_settings
from kvfabric.proto.codec import encode
from kvfabric.proto.eviction import (
    ADMISSION_FILTER_POOLS_MAX,
    AdmissionFilter,
    EvictionStatusRequest,
    PoolAdmission,
)

SECRET = b"x" * 32


@dataclass
class Shell:
    core: DirectoryCore


@dataclass
class Host:
    shells: dict[int, Shell] = field(default_factory=dict)


def message(pools: int = 1, at: int = 0) -> bytes:
    return encode(
        AdmissionFilter(
            generated_ms=at,
            events_seq=3,
            policy="density",
            pools=[PoolAdmission(segment_id=f"s{i}", group_bytes_max=[0] * 8) for i in range(pools)],
        )
    )


def test_a_filter_reaches_every_core_led_here() -> None:
    host = Host({s: Shell(DirectoryCore(DirectoryConfig(ticket_secret=SECRET), shard=s)) for s in range(3)})
    feed = AdmissionFilterFeed(host)
    assert ADMISSION_FILTER_SUBJECT == "kvf.v1.eviction.admission_filter"
    assert feed.on_filter(message(), 1_000)
    for shell in host.shells.values():
        assert shell.core.admission.decide(["s0"], bytes(48), 0, 1, 1_500) == (False, "below_frontier")
        assert shell.core.admission.decide(["s0"], bytes(48), 0, 1, 7_000) == (True, "stale")
    assert feed.age_ms(1_250) == 250 and feed.received == 1


def test_an_older_filter_than_the_cores_hold_is_counted_out_of_order_not_received() -> None:
    host = Host({s: Shell(DirectoryCore(DirectoryConfig(ticket_secret=SECRET), shard=s)) for s in range(2)})
    feed = AdmissionFilterFeed(host)
    assert feed.on_filter(message(at=500), 1_000)
    assert not feed.on_filter(message(at=100), 1_200)  # generated before the one held, still fresh
    assert (feed.received, feed.out_of_order) == (1, 1)
    assert feed.age_ms(1_300) == 300  # the held filter's age, not the refused one's
    names = {m.name: m.samples[0].value for m in AdmissionFilterCollector(feed).collect()}
    assert names["kvfabric_directory_admission_filters_out_of_order"] == 1
    # a shard newly led here takes the older one the others refuse: received, but the gauges
    # keep showing the newest filter
    host.shells[2] = Shell(DirectoryCore(DirectoryConfig(ticket_secret=SECRET), shard=2))
    assert feed.on_filter(message(pools=3, at=100), 1_400)
    assert feed.received == 2 and feed.view is not None and feed.view.generated_ms == 500
    assert feed.age_ms(1_500) == 500
    # once the held filter is stale every core takes an older-stamped one (a policy restarted
    # with its clock behind): the gauges show that one
    assert feed.on_filter(message(pools=2, at=50), 10_000)
    assert feed.view is not None and feed.view.generated_ms == 50 and feed.age_ms(10_100) == 100


def test_malformed_or_oversized_filters_are_dropped() -> None:
    host = Host({0: Shell(DirectoryCore(DirectoryConfig(ticket_secret=SECRET)))})
    feed = AdmissionFilterFeed(host)
    assert not feed.on_filter(b"\x00garbage", 0)
    assert not feed.on_filter(encode(EvictionStatusRequest()), 0)
    assert not feed.on_filter(message(pools=ADMISSION_FILTER_POOLS_MAX + 1), 0)
    assert feed.rejected == 3 and feed.view is None
    assert host.shells[0].core.admission.view is None


def test_metrics_show_the_filters_age_and_size() -> None:
    feed = AdmissionFilterFeed(Host())
    names = {m.name: m.samples[0].value for m in AdmissionFilterCollector(feed).collect()}
    assert names["kvfabric_directory_admission_filter_age_seconds"] == -1.0
    feed.on_filter(message(pools=2), 0)
    names = {m.name: m.samples[0].value for m in AdmissionFilterCollector(feed).collect()}
    assert names["kvfabric_directory_admission_filter_bytes"] == len(message(pools=2))
    assert names["kvfabric_directory_admission_filter_pools"] == 2
    assert names["kvfabric_directory_admission_filter_age_seconds"] > 0


def test_the_staleness_bound_is_a_setting() -> None:
    env = {"KVF_CLUSTER_SECRET": "s" * 16}
    assert load_directory_settings(env).core.admission_stale_ms == 5_000
    assert (
        load_directory_settings({**env, "KVF_DIRECTORY_ADMISSION_STALE_MS": "0"}).core.admission_stale_ms == 0
    )

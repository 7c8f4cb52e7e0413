"""The directory's leader election against a fake JetStream (kvfabric.directory.leader, its buckets
opened by kvfabric.directory.kv_buckets):

- opening a bucket on a forming NATS cluster: `create_key_value` refused (a 400: too few peers)
  and the bucket still missing is tried again with a bounded backoff, not taken as "created
  meanwhile" (the first start failed with BucketNotFoundError, docs/chaos.md nats-node-kill);
- a renewal without an answer (the KV's stream electing a leader) keeps the term and is retried;
  a refusal (wrong last sequence) ends it;
- KV operations run side by side: one that hangs does not hold up another shard's renewal.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from types import SimpleNamespace
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from kvfabric.core.leadership import LeadershipConfig
from kvfabric.directory import kv_buckets as kb
from kvfabric.directory import leader as ld
from kvfabric.runtime.deadline import cancel_and_wait

# Two shards, short terms: the leader loop's tests (a lease of 1.2 s renewed every 0.2 s)
TWO_SHARDS = LeadershipConfig(
    shards=2,
    lease_ttl_ms=1200,
    renew_every_ms=200,
    safety_margin_ms=200,
    members_ttl_ms=1200,
    renew_retry_ms=50,
)


class FakeJs:
    """key_value / create_key_value answering from scripted outcomes (an exception or a value)."""

    def __init__(self, key_value: list[Any], create: list[Any]) -> None:
        self.key_value_script = key_value
        self.create_script = create
        self.calls: list[str] = []

    async def key_value(self, name: str) -> Any:
        self.calls.append("key_value")
        return self._next(self.key_value_script)

    async def create_key_value(self, config: Any) -> Any:
        self.calls.append("create")
        return self._next(self.create_script)

    async def add_stream(self, config: Any) -> Any:
        self.calls.append(f"add_stream first_seq={config.first_seq}")

    @staticmethod
    def _next(script: list[Any]) -> Any:
        outcome = script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


class FakeNc:
    def __init__(self, js: Any) -> None:
        self.js = js

    def jetstream(self, timeout: float = 5.0) -> Any:
        return self.js


async def no_floor(*args: Any) -> None:
    return None


@pytest.fixture(autouse=True)
def never_repaired(monkeypatch: pytest.MonkeyPatch) -> None:
    """No bucket was recreated by kv_doctor (no floor claimed in the config bucket)."""
    monkeypatch.setattr(kb, "floor_of", no_floor)


def too_few_peers() -> nats.js.errors.BadRequestError:
    return nats.js.errors.BadRequestError(code=400, err_code=10005, description="insufficient resources")


def test_a_bucket_refused_on_a_forming_cluster_is_created_on_a_later_try(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kb, "BUCKET_RETRY_S", 0.01)
    missing = nats.js.errors.BucketNotFoundError
    js = FakeJs(
        key_value=[missing(), nats.errors.TimeoutError(), missing()],
        create=[too_few_peers(), "bucket"],
    )
    bucket: object = asyncio.run(kb.open_bucket(FakeNc(js), "KVF_DIRECTORY_LEADERS", 3.0, 3))  # type: ignore[arg-type]
    assert bucket == "bucket"
    assert js.calls == ["key_value", "create", "key_value", "key_value", "create"]


def test_a_bucket_created_meanwhile_by_another_instance_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kb, "BUCKET_RETRY_S", 0.01)
    already = nats.js.errors.BadRequestError(
        code=400, err_code=10058, description="stream name already in use"
    )
    js = FakeJs(key_value=[nats.js.errors.BucketNotFoundError(), "theirs"], create=[already])
    bucket: object = asyncio.run(kb.open_bucket(FakeNc(js), "B", None))  # type: ignore[arg-type]
    assert bucket == "theirs"


def test_opening_a_bucket_gives_up_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kb, "BUCKET_RETRY_S", 0.01)
    monkeypatch.setattr(kb, "BUCKET_RETRY_S_MAX", 0.01)
    js = FakeJs(key_value=[nats.js.errors.BucketNotFoundError()] * 1000, create=[too_few_peers()] * 1000)
    with pytest.raises(nats.js.errors.BadRequestError):
        asyncio.run(kb.open_bucket(FakeNc(js), "B", None, 3, timeout_s=0.1))  # type: ignore[arg-type]
    assert 3 <= js.calls.count("create") < 1000


class FakeLeaders:
    """The leaders bucket: `create` wins with revision 1; `update` follows a per-shard script
    (`ok`: the next revision, `hang`: never answers, an exception: raised)."""

    def __init__(self, updates: dict[int, list[Any]]) -> None:
        self.updates = updates
        self.revision = 0
        self.renewed: list[tuple[int, float]] = []
        self.deleted: list[tuple[str, int]] = []
        self.revisions: dict[str, int] = {}
        self.purged: list[tuple[str, str]] = []  # (stream, subject): `purge_stream` (as a FakeNc's js)

    async def create(self, key: str, value: bytes) -> int:
        self.revision += 1
        self.revisions[key] = self.revision
        return self.revision

    async def get(self, key: str) -> Any:
        if key not in self.revisions:
            raise nats.js.errors.KeyNotFoundError
        return SimpleNamespace(value=b"a", revision=self.revisions[key])  # every key is "a"'s here

    async def update(self, key: str, value: bytes, last: int) -> int:
        shard = int(key.removeprefix("shard-"))
        outcome = self.updates[shard].pop(0) if self.updates[shard] else "ok"
        if outcome == "hang":
            await asyncio.sleep(3600)
        if isinstance(outcome, BaseException):
            raise outcome
        self.revision += 1
        self.revisions[key] = self.revision
        self.renewed.append((shard, asyncio.get_running_loop().time()))
        return self.revision

    async def delete(self, key: str, last: int) -> None:
        self.deleted.append((key, last))

    async def put(self, key: str, value: bytes) -> int:
        return 0

    async def purge_stream(self, name: str, subject: str) -> bool:
        self.purged.append((name, subject))
        return True


async def run_election(
    updates: dict[int, list[Any]], seconds: float, *, rebalance: bool = False
) -> tuple[Any, list[Any], FakeLeaders]:
    config = TWO_SHARDS
    kv = FakeLeaders(updates)
    election = ld.LeaderElection(FakeNc(kv), "a", config, rebalance=rebalance)  # type: ignore[arg-type]
    election._leaders = kv  # type: ignore[assignment]
    election._members = kv  # type: ignore[assignment]
    stops: list[Any] = []

    async def on_start(shard: int, epoch: int) -> None:
        return None

    async def on_stop(shard: int, epoch: int, reason: str) -> None:
        stops.append((shard, reason))

    task = asyncio.create_task(election.run(on_start, on_stop))
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return election, stops, kv


def test_an_unanswered_renewal_is_retried_and_the_term_goes_on() -> None:
    timeout = nats.errors.TimeoutError()
    election, stops, _kv = asyncio.run(run_election({0: [timeout, timeout], 1: []}, 1.5))
    assert stops == []  # two renewals without an answer, then one that lands: nothing lost
    assert election.core.counters["renew_unanswered_total"] == 2
    assert set(election.core.leading()) == {0, 1}


def test_a_refused_renewal_ends_the_term() -> None:
    refused = nats.js.errors.KeyWrongLastSequenceError(description="wrong last sequence: 0")
    _election, stops, _ = asyncio.run(run_election({0: [refused], 1: []}, 0.6))
    assert (0, "renew_failed") in stops and all(shard == 0 for shard, _ in stops)


def test_a_hanging_renewal_does_not_hold_up_another_shards() -> None:
    """Shard 0's renewal never answers (cut at the term's time left, then retried, and so on);
    shard 1 renews on schedule all along and is never lost."""
    _election, stops, kv = asyncio.run(run_election({0: ["hang"] * 100, 1: []}, 2.0))
    assert [s for s, _ in stops] == [0]  # shard 0 stopped at its deadline (lease_expired) only
    assert stops == [(0, "lease_expired")]
    times = [t for shard, t in kv.renewed if shard == 1]
    assert len(times) >= 6 and max(b - a for a, b in itertools.pairwise(times)) < 0.6


def test_a_slow_members_listing_does_not_hold_up_the_renewals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The members listing (a stream request of up to 2 s) was awaited in the election loop,
    whose ticks send the renewals: one slow listing before a renewal was due cost every shard's
    lease, and the instance exited (review, stop 68). It runs beside the loop now."""
    listings = [0]

    async def slow_members(self: Any) -> set[str]:
        listings[0] += 1
        if listings[0] == 2:  # once the shards are led
            await asyncio.sleep(1.5)  # past the term (lease 1.2 s - margin 0.2 s)
        return {"a"}

    monkeypatch.setattr(ld.LeaderElection, "_live_members", slow_members)
    election, stops, kv = asyncio.run(run_election({0: [], 1: []}, 2.5, rebalance=True))
    assert stops == [] and set(election.core.leading()) == {0, 1}
    assert listings[0] >= 3  # listed again after the slow one
    times = [t for shard, t in kv.renewed if shard == 0]
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.6


def test_on_a_nats_cluster_the_default_lease_outlasts_a_stream_leader_election() -> None:
    """nats-server elects a stream leader after 4-9 s of silence (server/raft.go): the term (lease
    minus margin) must exceed 9 s plus one renewal interval; one nats-server keeps 3 s."""
    from kvfabric.directory.__main__ import leadership_config
    from kvfabric.directory.settings import load_directory_settings

    base = {"KVF_CLUSTER_SECRET": "0123456789abcdef0123"}
    single = leadership_config(load_directory_settings(base))
    assert (single.lease_ttl_ms, single.renew_every_ms, single.term_ms) == (3_000, 1_000, 2_500)
    cluster = leadership_config(load_directory_settings(dict(base, KVF_DIRECTORY_KV_REPLICAS="3")))
    assert cluster.lease_ttl_ms == 15_000 and cluster.renew_every_ms == 1_000
    assert cluster.term_ms > 9_000 + cluster.renew_every_ms and cluster.renew_retry_ms == 250
    chosen = load_directory_settings(
        dict(base, KVF_DIRECTORY_KV_REPLICAS="3", KVF_DIRECTORY_LEADER_LEASE_TTL_MS="1000")
    )
    assert leadership_config(chosen).renew_every_ms == 333


def test_an_orderly_stop_deletes_the_lease_keys_still_held_at_their_revisions() -> None:
    """A standby need not wait the TTL after an orderly stop: the keys are deleted with
    last=revision (so only if still ours). One whose renewal hung (cancelled and awaited as the
    loop ended) is read and deleted at the revision read, as it still holds this instance's id;
    the member key is purged (tests/integration/test_directory_leader_stop.py: on a real
    nats-server, another instance's key is kept)."""

    async def go() -> tuple[int, FakeLeaders]:
        election, stops, kv = await run_election({0: [], 1: ["hang"]}, 0.5)
        assert stops == [] and not election._ops  # the hanging renewal did not outlive the loop
        return await election.release_held(1.0), kv

    released, kv = asyncio.run(go())
    assert released == 2
    assert sorted(kv.deleted) == [("shard-0", kv.revisions["shard-0"]), ("shard-1", kv.revisions["shard-1"])]
    assert kv.purged == [("KV_KVF_DIRECTORY_MEMBERS", "$KV.KVF_DIRECTORY_MEMBERS.member-a")]


class StubbornCreate(FakeLeaders):
    """Shard 1's create never answers, and takes three cancels to end (a cancellation swallowed
    twice, as Python 3.11's `asyncio.wait_for` can)."""

    def __init__(self) -> None:
        super().__init__({0: [], 1: []})
        self.cancels = 0
        self.started = asyncio.Event()

    async def create(self, key: str, value: bytes) -> int:
        if key != "shard-1":
            return await super().create(key, value)
        self.started.set()
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancels += 1
                if self.cancels == 3:
                    raise


def test_the_loops_operations_end_with_it_under_the_services_stop() -> None:
    """The service stops the election loop with `cancel_and_wait` (`__main__`), which cancels it
    again while its end awaits the operations: that second cancel does not cut the wait short, so
    no operation outlives the loop (it would write after `release_held` read the bucket)."""
    config = TWO_SHARDS

    async def go() -> tuple[ld.LeaderElection, StubbornCreate, set[asyncio.Task[None]]]:
        kv = StubbornCreate()
        election = ld.LeaderElection(FakeNc(kv), "a", config)  # type: ignore[arg-type]
        election._leaders = kv  # type: ignore[assignment]
        election._members = kv  # type: ignore[assignment]

        async def ignored(*args: Any) -> None:
            return None

        task = asyncio.create_task(election.run(ignored, ignored))
        await asyncio.wait_for(kv.started.wait(), 30)
        ops = set(election._ops)
        assert ops and await cancel_and_wait([task], 30.0) == set()
        running = {op for op in ops if not op.done()}
        await cancel_and_wait(ops, 30.0)  # (so that this loop can close whatever happened)
        return election, kv, running

    election, kv, running = asyncio.run(go())
    assert running == set() and not election._ops
    assert kv.cancels == 3


class CreateAnsweredAtTheCancel(FakeLeaders):
    """Shard 1's create waits, and when cancelled answers all the same (Python 3.11's
    `asyncio.wait_for`, inside nats-py's request, returns a reply that came with the cancel)."""

    def __init__(self) -> None:
        super().__init__({0: [], 1: []})
        self.started = asyncio.Event()

    async def create(self, key: str, value: bytes) -> int:
        if key != "shard-1":
            return await super().create(key, value)
        self.started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
        return 77


def test_a_lease_won_as_the_loop_stops_starts_no_shard() -> None:
    """An acquire answered while `run` ends (its cancel swallowed) must not start the shard: the
    service took its list of start tasks already, so nothing would cancel or await that start
    (review of the change). Its key is the core's, so `release_held` deletes it."""
    config = TWO_SHARDS
    started: list[int] = []

    async def go() -> None:
        kv = CreateAnsweredAtTheCancel()
        election = ld.LeaderElection(FakeNc(kv), "a", config)  # type: ignore[arg-type]
        election._leaders = kv  # type: ignore[assignment]
        election._members = kv  # type: ignore[assignment]

        async def on_start(shard: int, epoch: int) -> None:
            started.append(shard)

        async def on_stop(*args: Any) -> None:
            return None

        task = asyncio.create_task(election.run(on_start, on_stop))
        await asyncio.wait_for(kv.started.wait(), 30)
        await asyncio.sleep(0.05)  # shard 0's start (before the stop) is not the point
        started.clear()
        await cancel_and_wait([task], 30.0)

    asyncio.run(go())
    assert started == []


def test_a_bucket_recreated_after_a_kept_write_error_comes_back_above_its_floor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kv_doctor claimed first_seq 4712 for the lease bucket it recreated; found missing (its add
    failed), the bucket is made from there, never from revision 1 (epochs already used)."""

    async def floor(nc: Any, stream: str, config_bucket: str) -> int | None:
        return 4712 if stream == "KV_KVF_DIRECTORY_LEADERS" else None

    monkeypatch.setattr(kb, "floor_of", floor)
    js = FakeJs(key_value=[nats.js.errors.BucketNotFoundError(), "bucket"], create=[])
    bucket: object = asyncio.run(kb.open_bucket(FakeNc(js), "KVF_DIRECTORY_LEADERS", 3.0))  # type: ignore[arg-type]
    assert bucket == "bucket"
    assert js.calls == ["key_value", "add_stream first_seq=4712", "key_value"]


def test_agreeing_on_the_shard_count_retries_a_bucket_without_a_stream_leader_yet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The config bucket just made on a forming cluster has no stream leader for a moment: its
    first `create` gets no stream response (the directory's first start failed on it)."""
    monkeypatch.setattr(kb, "BUCKET_RETRY_S", 0.01)

    class ConfigKv:
        def __init__(self) -> None:
            self.tries = 0

        async def create(self, key: str, value: bytes) -> int:
            self.tries += 1
            if self.tries < 3:
                raise nats.js.errors.NoStreamResponseError()
            return 1

    kv = ConfigKv()
    js = FakeJs(key_value=[kv], create=[])
    assert asyncio.run(kb.agree_on_shards(FakeNc(js), 16, 3)) == 16  # type: ignore[arg-type]
    assert kv.tries == 3

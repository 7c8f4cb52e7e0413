"""The read leases of prefetch hints are renewed until the hint's deadline, and a hint's deadline
is bounded (known defect "Prefetch: leases of a hint are not renewed past 30 s": a hint's lookup
took leases of at most 30 s, nothing renewed them, and a hint sent 2 minutes ahead had its
sources unprotected for 90 s while the service still counted the leases as held)."""

from __future__ import annotations

import random

import pytest

from kvfabric.core.prefetch import Hint, HintObject, PrefetchConfig, PrefetchCore
from kvfabric.core.prefetch_leases import HintLeases, LeaseKeeping, RenewLease

NAMED = ("t", "h1")
LEASE = (3, 7)
DEADLINE = 120_000


def keeper_with_one_lease(expires_ms: int = 30_000) -> HintLeases:
    keeper = HintLeases(LeaseKeeping(lease_ttl_ms=30_000, renew_margin_ms=10_000, retry_ms=1_000))
    keeper.keep(NAMED, [LEASE], expires_ms, now_ms=0)
    keeper.check_invariants()
    return keeper


def test_a_lease_is_renewed_before_it_expires_until_its_hints_deadline() -> None:
    keeper = keeper_with_one_lease()
    deadline = 120_000
    directory_expiry = 30_000  # the directory's view of the lease
    renewals: list[tuple[int, RenewLease]] = []
    for now in range(0, deadline + 1, 100):
        assert now < directory_expiry or now >= deadline  # never lapsed while the hint lived
        for renewal in keeper.due(now, lambda named: deadline):
            assert renewal.lease == LEASE and renewal.named == NAMED
            assert keeper.sending(renewal)
            renewals.append((now, renewal))
            directory_expiry = max(directory_expiry, now + renewal.ttl_ms)
            keeper.renewed(renewal.lease, directory_expiry, now)
        keeper.check_invariants()
    # 30 s leases renewed with 10 s left; the last one reaches the deadline, not 30 s past it
    assert [now for now, _ in renewals] == [20_000, 40_000, 60_000, 80_000, 100_000]
    assert [r.ttl_ms for _, r in renewals] == [30_000, 30_000, 30_000, 30_000, 20_000]
    assert directory_expiry == deadline
    assert keeper.counters["lease_renewals_total"] == 5 and keeper.counters["leases_lost_total"] == 0


def test_the_last_renewal_stops_at_the_hints_deadline() -> None:
    keeper = keeper_with_one_lease()
    (renewal,) = keeper.due(20_000, lambda named: 45_000)
    assert renewal.ttl_ms == 25_000  # to the deadline, not 30 s past now
    keeper.renewed(LEASE, 45_000, 20_000)
    assert keeper.expires_ms(LEASE) == 45_000
    for now in range(20_000, 45_000, 500):
        assert keeper.due(now, lambda named: 45_000) == []  # held to the deadline: nothing to renew
    keeper.check_invariants()


def test_a_lease_the_directory_dropped_is_no_longer_held() -> None:
    keeper = keeper_with_one_lease()
    (renewal,) = keeper.due(20_000, lambda named: 120_000)
    keeper.renew_failed(renewal.lease, lost=True, now_ms=20_050)  # not_found: a new leader, say
    keeper.check_invariants()
    assert keeper.held == {} and keeper.leases_held == 0
    assert keeper.counters["leases_lost_total"] == 1
    assert keeper.take(NAMED) == []  # nothing to give back at the hint's end


def test_a_failed_renewal_is_retried_after_a_while_and_the_lease_lapses_at_its_expiry() -> None:
    keeper = keeper_with_one_lease()
    asked = []
    for now in range(20_000, 31_000, 100):
        for renewal in keeper.due(now, lambda named: 120_000):
            asked.append(now)
            keeper.renew_failed(renewal.lease, lost=False, now_ms=now)  # timed out
        keeper.check_invariants()
    assert asked == list(range(20_000, 30_000, 1_000))  # once a second, never past its expiry
    assert keeper.counters["lease_renew_failed_total"] == 10
    assert keeper.leases_held == 0 and keeper.counters["leases_lost_total"] == 1  # lapsed at 30 s


def test_a_renewal_the_directory_refuses_is_not_sent_again() -> None:
    """The directory answers a renewal of a lease holding a lost group with its old expiry."""
    keeper = keeper_with_one_lease()
    (renewal,) = keeper.due(20_000, lambda named: 120_000)
    keeper.renewed(renewal.lease, 30_000, 20_010)  # not extended
    assert keeper.counters["lease_renew_refused_total"] == 1
    for now in range(20_010, 30_000, 100):
        assert keeper.due(now, lambda named: 120_000) == []
    assert keeper.leases_held == 1
    assert keeper.due(30_000, lambda named: 120_000) == [] and keeper.leases_held == 0  # lapsed
    keeper.check_invariants()


def renewed_under_a_cap(
    cap_ms: int, *, skew_ms: int = 0, lost_from_ms: int | None = None, held_until_ms: int = DEADLINE
) -> tuple[HintLeases, list[int]]:
    """A lease of a 2-minute hint renewed by a directory that grants at most `cap_ms` a request
    (`KVF_DIRECTORY_LEASE_TTL_MS_MAX`: 100 ms .. 600 s, the shell asks 30 s), its clock `skew_ms`
    ahead of ours, answering at once; from `lost_from_ms` its group is lost (the directory
    answers the lease's expiry unchanged). Checked every 50 ms until `held_until_ms` (with no
    lost group): the keeper holds it, and so does the directory. Returns the keeper and when
    each renewal was sent."""
    keeper = HintLeases(LeaseKeeping(lease_ttl_ms=30_000, renew_margin_ms=10_000, retry_ms=1_000))
    directory = skew_ms + min(30_000, cap_ms)  # the lookup's grant, on the directory's clock
    keeper.keep(NAMED, [LEASE], min(30_000, directory), now_ms=0)  # as the shell: min(asked, its)
    sent = []
    for now in range(0, DEADLINE, 50):
        if lost_from_ms is None and now < held_until_ms:
            assert keeper.leases_held == 1, f"dropped at {now} ms"
            assert now + skew_ms < directory, f"lapsed at the directory at {now} ms"
        for renewal in keeper.due(now, lambda named: DEADLINE):
            sent.append(now)
            if lost_from_ms is None or now < lost_from_ms:
                directory = max(directory, now + skew_ms + min(renewal.ttl_ms, cap_ms))
            keeper.renewed(renewal.lease, directory, now)
            if lost_from_ms is None and renewal.ttl_ms == 30_000:  # not asking to the deadline
                assert keeper.counters["lease_renew_refused_total"] == 0, f"refused at {now} ms"
        keeper.check_invariants()
    return keeper, sent


def test_a_directory_cap_shorter_than_asked_renews_earlier_and_never_refuses() -> None:
    """A renewal was called refused (FINAL) when the expiry moved less than half of what was
    asked: under a 15 s cap a 2-minute hint's lease was final after one renewal and lost at
    20 s; under a 2 s cap at once (review, stop 71). Now only an expiry the directory leaves
    where it was is a refusal, and a lease is renewed with a third of its granted TTL left."""
    for cap_ms, renewals in ((15_000, 11), (2_000, 88), (30_000, 5)):
        keeper, sent = renewed_under_a_cap(cap_ms)
        assert keeper.counters["lease_renew_refused_total"] == 0, cap_ms
        assert keeper.counters["leases_lost_total"] == 0, cap_ms
        assert abs(len(sent) - renewals) <= 1, (cap_ms, sent)
        assert keeper.expires_ms(LEASE) == DEADLINE  # the last renewal reached the deadline
    assert renewed_under_a_cap(15_000)[1][:3] == [10_000, 20_000, 30_000]  # 5 s left of 15 s
    assert renewed_under_a_cap(2_000)[1][:2] == [1_350, 2_700]  # 0.65 s left of 2 s
    assert renewed_under_a_cap(30_000)[1][:2] == [20_000, 40_000]  # 10 s left of 30 s, as before


@pytest.mark.parametrize("skew_ms", [-15_000, -12_000, 5_000])
def test_a_directory_clock_skewed_from_ours_does_not_refuse_a_lease(skew_ms: int) -> None:
    """A directory clock 12 s behind ours answered 18 s of the 30 s asked: called refused, and
    the lease was lost in its second renewal period (review, stop 71). Held to the directory's
    expiry now (the keeper's is the directory's when it is earlier than the one asked: a clock
    behind ends it early in the keeper's books, never late; the last renewal, to the deadline,
    may then be answered unmoved)."""
    renewed_under_a_cap(30_000, skew_ms=skew_ms, held_until_ms=DEADLINE + min(0, skew_ms))


@pytest.mark.parametrize("cap_ms", [30_000, 15_000, 2_000])
def test_a_lost_group_under_any_cap_is_final_after_one_unmoved_answer(cap_ms: int) -> None:
    keeper, sent = renewed_under_a_cap(cap_ms, lost_from_ms=40_000)
    first_lost = next(i for i, now in enumerate(sent) if now >= 40_000)
    assert sent[first_lost + 1 :] == []  # never sent again once answered unmoved
    assert keeper.counters["lease_renew_refused_total"] == 1
    assert keeper.leases_held == 0 and keeper.counters["leases_lost_total"] == 1  # lapsed


def test_a_renewal_is_counted_when_sent() -> None:
    """`lease_renewals_total` counted in `due` took in renewals never sent: the hint ended while
    it waited (review, stop 71)."""
    keeper = keeper_with_one_lease()
    (renewal,) = keeper.due(20_000, lambda named: 120_000)
    assert keeper.counters["lease_renewals_total"] == 0  # due, not sent yet
    assert keeper.take(NAMED) == [LEASE]  # its hint ended meanwhile
    assert not keeper.sending(renewal)
    assert keeper.counters["lease_renewals_total"] == 0
    keeper = keeper_with_one_lease()
    (renewal,) = keeper.due(20_000, lambda named: 120_000)
    assert keeper.sending(renewal) and keeper.counters["lease_renewals_total"] == 1


def test_an_ended_hints_leases_are_taken_and_never_renewed() -> None:
    keeper = keeper_with_one_lease()
    assert keeper.take(NAMED) == [LEASE] and keeper.held == {}
    assert keeper.due(25_000, lambda named: 120_000) == []
    keeper.renewed(LEASE, 55_000, 25_000)  # a late answer for a lease given back: ignored
    keeper.check_invariants()
    assert keeper.leases_held == 0


def test_a_lease_whose_hints_deadline_moves_later_is_renewed() -> None:
    """A hint id deduplicated into a live hint makes its deadline the later one."""
    keeper = keeper_with_one_lease()
    deadline = {"ms": 30_000}
    assert keeper.due(25_000, lambda named: deadline["ms"]) == []  # held to the deadline already
    deadline["ms"] = 90_000
    (renewal,) = keeper.due(26_000, lambda named: deadline["ms"])  # looked at again within 1 s
    assert renewal.ttl_ms == 30_000
    keeper.check_invariants()


def test_renewals_are_sorted_by_shard_and_the_heap_stays_bounded() -> None:
    keeper = HintLeases()
    rng = random.Random(5)
    for i in range(200):
        keeper.keep(("t", f"h{i}"), [(rng.randrange(8), 1000 + i)], 30_000 + rng.randrange(5_000), 0)
    for now in range(0, 200_000, 250):
        due = keeper.due(now, lambda named: 150_000 if int(named[1][1:]) % 2 else 60_000)
        assert [r.lease for r in due] == sorted(r.lease for r in due)
        for renewal in due:
            if rng.random() < 0.2:
                keeper.renew_failed(renewal.lease, lost=rng.random() < 0.1, now_ms=now)
            else:
                keeper.renewed(renewal.lease, now + renewal.ttl_ms, now)
        if now % 10_000 == 0:
            for i in rng.sample(range(200), 5):
                keeper.take(("t", f"h{i}"))
        keeper.check_invariants()
        for leases in keeper.held.values():
            for lease in leases:  # held means held at the directory
                expires = keeper.expires_ms(lease)
                assert expires is not None and now < expires


def hint(deadline_ms: int, hint_id: str = "h1") -> Hint:
    return Hint(hint_id, "t", "target", (HintObject("o1", 10, ("s1",)),), deadline_ms)


def test_a_hints_deadline_is_cut_to_the_hold_maximum() -> None:
    core = PrefetchCore(PrefetchConfig(hint_hold_ms_max=300_000, copies_in_flight_max=1))
    now = 1_000_000
    core.add_hint(hint(now + 3_600_000), now)  # an hour ahead: its leases renewed for an hour
    assert core.hint_deadline("h1", "t") == now + 300_000
    assert core.counters["hints_deadline_capped_total"] == 1
    core.add_hint(hint(now + 7_200_000, "h2"), now + 10_000)  # joins it: still bounded
    assert core.hint_deadline("h2", "t") == now + 310_000
    assert core.hint_deadline("nope", "t") is None
    core.check_invariants()
    core.tick(now + 310_000)
    assert core.hint_deadline("h1", "t") is None and core.counters["hints_expired_total"] == 1
    core.add_hint(hint(now + 400_000, "h3"), now + 310_000)  # within the bound: kept as sent
    assert core.hint_deadline("h3", "t") == now + 400_000
    assert core.counters["hints_deadline_capped_total"] == 2


def test_a_last_renewal_cut_to_the_deadline_under_a_clock_behind_is_no_refusal() -> None:
    """The directory's clock 500 ms behind ours: the last renewal, cut to the hint's deadline,
    is answered an expiry no later than its last one. It was booked refused (a lost group), the
    lease then lost at its expiry (review of the change, stop 71): it is held to its expiry, and
    its lapse there loses nothing."""
    behind_ms = 500
    deadline = 30_300  # just after the lookup's expiry (the directory's view)
    keeper = keeper_with_one_lease(expires_ms=30_000)
    directory_expiry = 30_000
    for now in range(0, 40_000, 100):
        for renewal in keeper.due(now, lambda named: deadline):
            ttl = keeper.sending(renewal, now)
            assert 0 < ttl <= deadline - now
            directory_expiry = max(directory_expiry, now - behind_ms + ttl)  # its clock
            keeper.renewed(renewal.lease, directory_expiry, now)
        keeper.check_invariants()
    assert keeper.counters["lease_renew_refused_total"] == 0
    assert keeper.counters["leases_lost_total"] == 0


def test_a_renewal_that_waited_asks_only_up_to_the_deadline_from_when_it_is_sent() -> None:
    """A renewal due at 20 s and sent 8 s later (its shard's slots busy) asked the TTL computed
    when due, and was granted past the hint's deadline (review of the change, stop 71)."""
    keeper = keeper_with_one_lease()
    (renewal,) = keeper.due(20_000, lambda named: 45_000)
    assert renewal.ttl_ms == 25_000
    assert keeper.sending(renewal, 28_000) == 17_000  # up to the deadline from now
    keeper.renewed(LEASE, 45_000, 28_100)
    assert keeper.expires_ms(LEASE) == 45_000
    # one sent after the deadline asks nothing: held to its expiry
    other = keeper_with_one_lease()
    (renewal,) = other.due(20_000, lambda named: 35_000)
    assert other.sending(renewal, 36_000) == 0 and other.counters["lease_renewals_total"] == 0
    other.check_invariants()


# ---- renewals started per round, releases (review of stop 71) ------------------------------


def keeper_due_at(leases: dict[tuple[int, int], int]) -> HintLeases:
    """Each lease kept at 0 with the expiry given, its own hint (all due from 20 s on)."""
    keeper = HintLeases(LeaseKeeping(lease_ttl_ms=30_000, renew_margin_ms=10_000, retry_ms=1_000))
    for lease, expires in leases.items():
        keeper.keep(("t", f"h{lease[0]}-{lease[1]}"), [lease], expires, now_ms=0)
    return keeper


def test_a_round_starts_at_most_its_limits_earliest_expiry_first_and_the_rest_wait() -> None:
    """Every renewal due was started at once, and the shell made a task for each (thousands in
    one tick on one shard, waiting for its 16 slots). A round now starts at most `limit` in all
    and `shard_room(shard)` on each, earliest expiry first; the rest stay due for later rounds."""
    rng = random.Random(7)
    expiry = {(0, i): 30_000 + rng.randrange(5_000) for i in range(1, 3_001)}
    expiry |= {(1, i): 30_000 + rng.randrange(5_000) for i in range(1, 101)}
    keeper = keeper_due_at(expiry)
    in_flight = {0: 0, 1: 0}
    started: list[RenewLease] = []
    for rnd, now in enumerate(range(25_000, 31_000, 20)):
        due = keeper.due(now, lambda named: 120_000, limit=64, shard_room=lambda s: 16 - in_flight[s])
        keeper.check_invariants()
        if rnd == 0:  # per shard at most its room; in all at most the limit
            assert [sum(r.shard == s for r in due) for s in (0, 1)] == [16, 16]
            assert keeper.renewals_queued == 3_100 - 32
        assert len(due) <= 64 and all(sum(r.shard == s for r in due) <= 16 for s in (0, 1))
        for renewal in due:  # each answered within the round
            assert keeper.sending(renewal, now)
            keeper.renewed(renewal.lease, now + renewal.ttl_ms, now)
        started += sorted(due, key=lambda r: expiry[r.lease])  # (a round's: sorted by lease)
    # all renewed, none late, each shard's in expiry order
    assert len(started) == len({r.lease for r in started}) == 3_100
    for shard in (0, 1):
        mine = [expiry[r.lease] for r in started if r.shard == shard]
        assert mine == sorted(mine)
    assert keeper.counters["lease_renewals_late_total"] == 0 and keeper.counters["leases_lost_total"] == 0


def test_the_round_limit_goes_to_the_earliest_expiries_across_shards() -> None:
    keeper = keeper_due_at({(0, 1): 30_000, (1, 1): 31_000, (2, 1): 29_000, (0, 2): 29_500})
    due = keeper.due(25_000, lambda named: 120_000, limit=2, shard_room=lambda s: 16)
    assert sorted(r.lease for r in due) == [(0, 2), (2, 1)]
    due = keeper.due(25_020, lambda named: 120_000, limit=2)
    assert sorted(r.lease for r in due) == [(0, 1), (1, 1)]
    keeper.check_invariants()


def test_a_short_lease_due_later_starts_before_a_long_one_due_earlier() -> None:
    """Ordered by expiry, not by when each fell due: a lease under a short directory cap (due
    with a third of its 2 s left) goes before one with 10 s left."""
    keeper = HintLeases(LeaseKeeping(lease_ttl_ms=30_000, renew_margin_ms=10_000, retry_ms=1_000))
    keeper.keep(("t", "long"), [(0, 1)], 30_000, now_ms=0)  # due at 20 s
    keeper.keep(("t", "short"), [(0, 2)], 21_000, now_ms=19_000)  # due at 20.34 s
    assert [r.lease for r in keeper.due(20_500, lambda named: 120_000, limit=1)] == [(0, 2)]
    assert [r.lease for r in keeper.due(20_520, lambda named: 120_000, limit=1)] == [(0, 1)]


def test_a_renewal_that_cannot_start_before_its_expiry_is_counted_late() -> None:
    keeper = keeper_due_at({(0, 1): 30_000, (0, 2): 40_000})
    full = {"room": 0}  # the shard's slots all taken (a hung leader)
    for now in range(20_000, 30_000, 20):
        assert keeper.due(now, lambda named: 120_000, shard_room=lambda s: full["room"]) == []
        keeper.check_invariants()
    assert keeper.leases_held == 2 and keeper.renewals_queued == 1
    assert keeper.due(30_000, lambda named: 120_000, shard_room=lambda s: full["room"]) == []
    assert keeper.counters["lease_renewals_late_total"] == 1 and keeper.counters["leases_lost_total"] == 1
    assert keeper.held == {("t", "h0-2"): [(0, 2)]}  # no longer counted as held
    full["room"] = 1
    (renewal,) = keeper.due(30_020, lambda named: 120_000, shard_room=lambda s: full["room"])
    assert renewal.lease == (0, 2)
    keeper.check_invariants()


def test_a_due_lease_whose_hint_ended_is_taken_not_renewed() -> None:
    keeper = keeper_due_at({(0, 1): 30_000})
    assert keeper.due(20_000, lambda named: 120_000, shard_room=lambda s: 0) == []
    assert keeper.give_back(("t", "h0-1"), 20_100) == [(0, 1)]
    assert keeper.due(20_200, lambda named: 120_000) == [] and keeper.renewals_queued == 0
    (release,) = keeper.releases(20_200)
    assert release.lease == (0, 1) and release.attempt == 1
    keeper.check_invariants()


def test_releases_go_per_shard_within_room_each_on_its_own() -> None:
    """Releases went in batches of 16 awaited whole: one unanswered held the 15 others and all
    behind them. Each is started on its own now, within its shard's room and the round's."""
    keeper = HintLeases()
    for i in range(40):
        keeper.keep(("t", f"a{i}"), [(0, 100 + i)], 30_000, now_ms=0)
    for i in range(5):
        keeper.keep(("t", f"b{i}"), [(1, 200 + i)], 30_000, now_ms=0)
    for named in list(keeper.held):
        keeper.give_back(named, 1_000)
    in_flight = {0: 0, 1: 0}
    room = lambda shard: 16 - in_flight[shard]  # noqa: E731
    first = keeper.releases(1_000, limit=64, shard_room=room)
    assert [r.lease for r in first] == [(0, 100 + i) for i in range(16)] + [(1, 200 + i) for i in range(5)]
    hung = first[0]  # never answered: keeps its slot
    in_flight[0] = 1
    for release in first[1:]:
        keeper.release_done(release.lease)
    keeper.check_invariants()
    second = keeper.releases(1_020, limit=64, shard_room=room)
    assert [r.lease for r in second] == [(0, 116 + i) for i in range(15)]  # 15: one slot held
    for release in second:
        keeper.release_done(release.lease)
    third = keeper.releases(1_040, limit=4, shard_room=room)  # the round's limit
    assert [r.lease for r in third] == [(0, 131 + i) for i in range(4)]
    assert keeper.releases_pending == 1 + 4 + 5 and hung.attempt == 1
    keeper.check_invariants()


def test_a_failed_release_is_retried_a_bounded_number_of_times_within_its_lease() -> None:
    keeper = HintLeases(LeaseKeeping(retry_ms=1_000, release_attempts_max=3))
    keeper.keep(("t", "h"), [(0, 1)], 30_000, now_ms=0)
    keeper.keep(("t", "short"), [(0, 2)], 10_500, now_ms=0)
    keeper.give_back(("t", "h"), 10_000)
    keeper.give_back(("t", "short"), 10_000)
    sent: list[tuple[int, int, int]] = []
    for now in range(10_000, 20_000, 20):
        for release in keeper.releases(now):
            sent.append((now, release.lease_id, release.attempt))
            keeper.release_failed(release.lease, now + 10)  # timed out, say
        keeper.check_invariants()
    # the short one: no retry past its expiry; the other three times, a second apart
    assert sent == [(10_000, 1, 1), (10_000, 2, 1), (11_020, 1, 2), (12_040, 1, 3)]
    assert keeper.counters["lease_release_failed_total"] == 4
    assert keeper.counters["lease_releases_abandoned_total"] == 2 and keeper.releases_pending == 0
    # one that succeeds on its retry is done
    keeper.keep(("t", "h2"), [(0, 3)], 30_000, now_ms=0)
    keeper.give_back(("t", "h2"), 10_000)
    (release,) = keeper.releases(10_000)
    keeper.release_failed(release.lease, 10_000)
    assert keeper.releases(10_500) == []
    (release,) = keeper.releases(11_000)
    assert release.attempt == 2
    keeper.release_done(release.lease)
    assert keeper.releases_pending == 0 and keeper.counters["lease_releases_abandoned_total"] == 2


def test_releases_ready_counts_what_a_round_could_start_and_the_next_retry_is_known() -> None:
    """What the shell asks to start a round between ticks only when one can start something: the
    releases queued within each shard's room (`releases_ready`, the retries due requeued first)
    and when the first retry comes due (`next_release_retry_ms`)."""
    keeper = HintLeases(LeaseKeeping(retry_ms=1_000))
    for i in range(20):
        keeper.keep(("t", f"a{i}"), [(0, 100 + i)], 30_000, now_ms=0)
    for i in range(3):
        keeper.keep(("t", f"b{i}"), [(1, 200 + i)], 30_000, now_ms=0)
    for named in list(keeper.held):
        keeper.give_back(named, 1_000)
    in_flight = {0: 0, 1: 0}
    room = lambda shard: 16 - in_flight[shard]  # noqa: E731
    assert keeper.releases_ready(1_000) == 23 and keeper.releases_ready(1_000, room) == 16 + 3
    assert keeper.next_release_retry_ms() is None
    started = keeper.releases(1_000, shard_room=room)
    assert len(started) == 19 and keeper.releases_ready(1_000) == 4  # shard 0's last 4
    in_flight = {0: 16, 1: 3}
    assert keeper.releases_ready(1_000, room) == 0  # shard 0's room full, shard 1's queue empty
    in_flight[0] = 15  # one answered on shard 0: its room freed
    keeper.release_done(started[0].lease)
    assert keeper.releases_ready(1_010, room) == 1
    failed = started[16]  # shard 1's first: sent again at 2 010
    keeper.release_failed(failed.lease, 1_010)
    in_flight[1] = 2
    assert keeper.next_release_retry_ms() == 2_010
    assert keeper.releases_ready(2_009, room) == 1  # not due yet
    assert keeper.releases_ready(2_010, room) == 2 and keeper.next_release_retry_ms() is None
    again = keeper.releases(2_010, shard_room=room)
    assert [r.lease for r in again] == [(0, 116), failed.lease] and again[1].attempt == 2
    in_flight = {0: 16, 1: 3}
    assert keeper.releases_ready(2_010, room) == 0 and keeper.releases_ready(2_010) == 3
    keeper.check_invariants()


def test_ready_on_a_shard_and_a_capped_count_do_not_walk_every_shard() -> None:
    """When a release ends the shell asks only of its shard (`ready_on`: a release queued there,
    the retries due requeued first), and after a round counts a batch at most (`at_most`: the
    walk stops there); asking `releases_ready` of every shard per release ended was quadratic
    (review of the change)."""
    keeper = HintLeases(LeaseKeeping(retry_ms=1_000))
    for shard in range(100):
        keeper.keep(("t", f"h{shard}"), [(shard, 100 + shard), (shard, 200 + shard)], 30_000, now_ms=0)
    for named in list(keeper.held):
        keeper.give_back(named, 1_000)
    asked: list[int] = []

    def room(shard: int) -> int:
        asked.append(shard)
        return 1

    assert keeper.releases_ready(1_000, room, at_most=16) == 16 and len(asked) == 16
    assert keeper.releases_ready(1_000, room) == 100 and keeper.releases_ready(1_000, at_most=500) == 200
    started = keeper.releases(1_000, shard_room=room)  # one a shard: each shard's second waits
    assert len(started) == 100 and keeper.ready_on(7, 1_000) and not keeper.ready_on(100, 1_000)
    keeper.releases(1_000)  # every second one started
    assert not keeper.ready_on(7, 1_000)
    keeper.release_failed(started[7].lease, 1_000)  # shard 7's first: sent again at 2 000
    assert not keeper.ready_on(7, 1_999) and keeper.ready_on(7, 2_000)  # the retry requeued
    assert keeper.next_release_retry_ms() is None
    keeper.check_invariants()


def test_the_release_queue_is_bounded_and_expired_leases_are_not_released() -> None:
    keeper = HintLeases(LeaseKeeping(release_queue_max=10))
    for i in range(15):
        keeper.keep(("t", f"h{i}"), [(0, 100 + i)], 30_000, now_ms=0)
    keeper.keep(("t", "old"), [(0, 99)], 5_000, now_ms=0)
    for named in list(keeper.held):
        keeper.give_back(named, 6_000)
    # the expired one is not queued (nothing to give back); past the bound: counted, left to expire
    assert keeper.releases_pending == 10 and keeper.counters["lease_releases_dropped_total"] == 5
    keeper.check_invariants()
    # a queued one whose lease expires before it could go: dropped when reached, counted
    assert keeper.releases(6_000, shard_room=lambda s: 0) == []
    assert keeper.releases(30_000) == []
    assert keeper.releases_pending == 0 and keeper.counters["lease_releases_abandoned_total"] == 10
    # an untracked lease (no expiry known) is given one TTL from now
    keeper.held[("t", "x")] = [(2, 5), (2, 0)]  # lease id 0: none granted, nothing to release
    keeper.give_back(("t", "x"), 40_000)
    assert [r.lease for r in keeper.releases(40_000 + 29_999)] == [(2, 5)]
    keeper.check_invariants()


def test_renewals_and_releases_under_random_limits_keep_the_invariants() -> None:
    rng = random.Random(11)
    keeper = HintLeases(LeaseKeeping(release_queue_max=300))
    in_flight: dict[int, int] = {}
    renewing: list[RenewLease] = []
    releasing: list[tuple[int, int]] = []
    n = 0
    for now in range(0, 200_000, 100):
        for _ in range(rng.randrange(4)):
            n += 1
            keeper.keep(("t", f"h{n}"), [(rng.randrange(4), n)], now + 30_000, now)
        due = keeper.due(
            now,
            lambda named: 150_000 if int(named[1][1:]) % 2 else 60_000,
            limit=rng.randrange(1, 20),
            shard_room=lambda s: 8 - in_flight.get(s, 0),
        )
        for renewal in due:
            in_flight[renewal.shard] = in_flight.get(renewal.shard, 0) + 1
        renewing += due
        rng.shuffle(renewing)
        for renewal in renewing[: rng.randrange(len(renewing) + 1)]:
            renewing.remove(renewal)
            in_flight[renewal.shard] -= 1
            if keeper.sending(renewal, now):
                if rng.random() < 0.2:
                    keeper.renew_failed(renewal.lease, lost=rng.random() < 0.1, now_ms=now)
                else:
                    keeper.renewed(renewal.lease, now + renewal.ttl_ms, now)
        if rng.random() < 0.1:
            for named in rng.sample(list(keeper.held), min(10, len(keeper.held))):
                keeper.give_back(named, now)
        ready, abandoned = keeper.releases_ready(now), keeper.counters["lease_releases_abandoned_total"]
        limit = rng.randrange(1, 10)
        started = keeper.releases(now, limit=limit)
        dropped = keeper.counters["lease_releases_abandoned_total"] - abandoned
        # `releases_ready`: what a round with no limit would take (started, or dropped expired)
        assert len(started) == limit or len(started) + dropped == ready
        releasing += [r.lease for r in started]
        for lease in releasing[: rng.randrange(len(releasing) + 1)]:
            releasing.remove(lease)
            if rng.random() < 0.3:
                keeper.release_failed(lease, now)
            else:
                keeper.release_done(lease)
        keeper.check_invariants()
    assert keeper.counters["lease_renewals_total"] > 500
    assert keeper.counters["lease_release_failed_total"] > 10


def test_a_lease_taken_while_its_renewal_is_in_flight_is_given_back_with_the_expiry_asked() -> None:
    """Review of the change (stop 71): a lease whose renewal was sent and not yet answered was
    given back with its old expiry. A renewal sent 0.5 s before it, granted to +30 s, and the
    hint ending before the answer came: nothing was queued (the old expiry had passed), the
    answer was dropped (the lease no longer tracked), and the lease stayed pinned ~30 s."""
    keeper = keeper_with_one_lease(expires_ms=30_000)
    (renewal,) = keeper.due(29_500, lambda named: 200_000)
    assert keeper.sending(renewal, 29_500) == 30_000  # asked until 59 500
    assert keeper.give_back(NAMED, 30_100) == [LEASE]  # the hint ended before the answer
    assert keeper.releases_pending == 1
    keeper.renewed(LEASE, 59_500, 30_200)  # the answer: granted, dropped (not tracked)
    keeper.check_invariants()
    (release,) = keeper.releases(30_200)
    assert release.lease == LEASE and release.attempt == 1
    keeper.release_done(release.lease)
    assert keeper.releases_pending == 0 and keeper.counters["lease_releases_abandoned_total"] == 0


def test_a_release_of_a_lease_renewed_in_flight_lives_to_the_expiry_asked() -> None:
    """Given back while its renewal (to 50 s) is in flight: a release failing near the old expiry
    (30 s) is retried, not abandoned, and one queued past the old expiry still goes; it is
    given up only at the expiry asked."""
    keeper = keeper_with_one_lease(expires_ms=30_000)
    (renewal,) = keeper.due(20_000, lambda named: 200_000)
    assert keeper.sending(renewal, 20_000) == 30_000  # asked until 50 000
    keeper.give_back(NAMED, 20_010)
    (release,) = keeper.releases(20_010)
    keeper.release_failed(release.lease, 29_500)  # no answer by the shell's deadline
    assert keeper.releases_pending == 1 and keeper.counters["lease_releases_abandoned_total"] == 0
    assert keeper.releases(30_000) == []  # waiting to be retried (at 30 500)
    (again,) = keeper.releases(30_500)  # past the old expiry: the directory may still hold it
    assert again.attempt == 2
    keeper.release_failed(again.lease, 49_000)
    assert keeper.releases(50_000) == []  # the retry (at 50 000) reaches the expiry asked: given up
    assert keeper.releases_pending == 0 and keeper.counters["lease_releases_abandoned_total"] == 1
    keeper.check_invariants()
    # queued, never started before the old expiry: still sent after it (the expiry asked)
    keeper = keeper_with_one_lease(expires_ms=30_000)
    (renewal,) = keeper.due(20_000, lambda named: 200_000)
    keeper.sending(renewal, 20_000)
    keeper.give_back(NAMED, 20_010)
    assert keeper.releases(20_010, shard_room=lambda shard: 0) == []  # its shard full
    assert [r.lease for r in keeper.releases(31_000)] == [LEASE]
    assert keeper.counters["lease_releases_abandoned_total"] == 0


def test_a_lease_taken_before_its_renewal_was_sent_keeps_its_own_expiry() -> None:
    """A renewal started (`due`) but not yet sent when its hint ends is never sent (`sending`
    says 0): the lease lives to its own expiry only, and its release is given up there."""
    keeper = keeper_with_one_lease(expires_ms=30_000)
    (renewal,) = keeper.due(20_000, lambda named: 200_000)
    keeper.give_back(NAMED, 20_010)
    assert keeper.sending(renewal, 20_020) == 0
    assert keeper.releases(30_000) == [] and keeper.counters["lease_releases_abandoned_total"] == 1
    keeper = keeper_with_one_lease(expires_ms=30_000)
    keeper.due(29_500, lambda named: 200_000)
    keeper.give_back(NAMED, 30_100)  # expired already: nothing to give back
    assert keeper.releases_pending == 0


def test_leases_no_hint_kept_are_queued_like_an_ended_hints() -> None:
    """`release`: a lookup's leases no hint keeps (outside the hit, a hint busy, refused or that
    queued nothing) go through the same bounded, retried queue, with the expiry given (None:
    one TTL from now); lease id 0 and leases expired already are not queued."""
    keeper = HintLeases(LeaseKeeping(lease_ttl_ms=30_000, retry_ms=1_000))
    keeper.release([(0, 1), (1, 2), (2, 0)], 10_000, 1_000)
    keeper.release([(3, 4)], 900, 1_000)  # expired: nothing to give back
    keeper.release([(4, 5)], None, 1_000)  # unknown: until 31 000
    keeper.release([(0, 1)], 10_000, 1_000)  # queued already
    assert keeper.releases_pending == 3 and keeper.held == {}
    keeper.check_invariants()
    sent = keeper.releases(1_000)
    assert sorted(r.lease for r in sent) == [(0, 1), (1, 2), (4, 5)]
    for release in sent:
        keeper.release_failed(release.lease, 9_500)
    assert [r.lease for r in keeper.releases(10_500)] == [(4, 5)]  # the others' retry past 10 s
    assert keeper.counters["lease_releases_abandoned_total"] == 2
    keeper.check_invariants()


def test_a_lease_whose_renewals_answer_was_lost_is_given_back_with_the_expiry_asked() -> None:
    """Review of the change: a renewal sent at 20 s asking to 50 s timed out (`renew_failed`,
    not lost: the directory may have granted it), and the hint was cancelled at 25.5 s, before a
    retry renewed it. The release was held only to the old expiry (30 s): one failing near it was
    given up, and one queued past it dropped, while the directory may hold the lease to 50 s."""
    keeper = keeper_with_one_lease(expires_ms=30_000)
    (renewal,) = keeper.due(20_000, lambda named: 300_000)
    assert keeper.sending(renewal, 20_000) == 30_000  # asked until 50 000
    keeper.renew_failed(LEASE, lost=False, now_ms=25_000)  # no answer: timed out
    keeper.check_invariants()
    assert keeper.give_back(NAMED, 25_500) == [LEASE]
    (release,) = keeper.releases(25_500)
    keeper.release_failed(release.lease, 29_500)  # no answer by the shell's deadline
    assert keeper.releases_pending == 1 and keeper.counters["lease_releases_abandoned_total"] == 0
    (again,) = keeper.releases(30_500)  # past the old expiry: the directory may still hold it
    assert again.attempt == 2
    keeper.release_failed(again.lease, 49_500)
    assert keeper.releases_pending == 0 and keeper.counters["lease_releases_abandoned_total"] == 1
    keeper.check_invariants()
    # queued, its shard full until past the old expiry: still sent (it may hold to 50 s)
    keeper = keeper_with_one_lease(expires_ms=30_000)
    (renewal,) = keeper.due(20_000, lambda named: 300_000)
    keeper.sending(renewal, 20_000)
    keeper.renew_failed(LEASE, lost=False, now_ms=25_000)
    keeper.give_back(NAMED, 25_500)
    assert keeper.releases(25_500, shard_room=lambda shard: 0) == []
    assert [r.lease for r in keeper.releases(31_000)] == [LEASE]
    assert keeper.counters["lease_releases_abandoned_total"] == 0


def test_a_lease_whose_renewals_all_fail_is_released_at_its_lapse() -> None:
    """Review of the change: renewals sent and all timing out until the lease's old expiry: it
    was dropped as lapsed with no release at all, while the directory may hold it to the last
    expiry asked (29 s + 30 s), pinned ~30 s. Now it is dropped (lost to its hint) and released,
    held to that expiry."""
    keeper = keeper_with_one_lease(expires_ms=30_000)
    sent = []
    for now in range(20_000, 31_000, 100):
        for renewal in keeper.due(now, lambda named: 300_000):
            assert keeper.sending(renewal, now)
            sent.append(now)
            keeper.renew_failed(renewal.lease, lost=False, now_ms=now)  # timed out
        keeper.check_invariants()
    assert sent == list(range(20_000, 30_000, 1_000))
    assert keeper.leases_held == 0 and keeper.counters["leases_lost_total"] == 1  # lapsed at 30 s
    assert keeper.releases_pending == 1
    (release,) = keeper.releases(30_000)
    assert release.lease == LEASE
    keeper.release_failed(release.lease, 57_000)
    assert [r.attempt for r in keeper.releases(58_000)] == [2]  # held to 59 000 (29 s + 30 s)
    keeper.release_failed(LEASE, 58_500)  # its retry (59 500) past 59 000: given up
    assert keeper.releases_pending == 0 and keeper.counters["lease_releases_abandoned_total"] == 1
    keeper.check_invariants()


def test_a_renewal_refused_or_never_sent_makes_no_release_at_a_lapse() -> None:
    """Only a renewal sent and left unanswered may have been granted: one `not_found` drops the
    lease (the directory holds none), one never sent leaves its expiry, and their lapse or end
    queues nothing past it."""
    keeper = keeper_with_one_lease(expires_ms=30_000)
    (renewal,) = keeper.due(20_000, lambda named: 300_000)
    keeper.sending(renewal, 20_000)
    keeper.renew_failed(LEASE, lost=True, now_ms=20_050)  # not_found
    assert keeper.leases_held == 0 and keeper.releases_pending == 0
    keeper = keeper_with_one_lease(expires_ms=30_000)
    for now in range(20_000, 31_000, 100):  # started, never sent (`sending` not called)
        for renewal in keeper.due(now, lambda named: 300_000):
            keeper.renew_failed(renewal.lease, lost=False, now_ms=now)
    assert keeper.leases_held == 0 and keeper.releases_pending == 0
    # a renewal answered after one lost: the lost one may still reach the directory, so the
    # lease is still given back held to the later of the two
    keeper = keeper_with_one_lease(expires_ms=30_000)
    (renewal,) = keeper.due(20_000, lambda named: 40_000)
    keeper.sending(renewal, 20_000)  # asked until 40 000 (its deadline)
    keeper.renew_failed(LEASE, lost=False, now_ms=20_500)
    keeper.give_back(NAMED, 35_000)
    assert [r.lease for r in keeper.releases(35_000)] == [LEASE]


def test_a_lookups_late_bound_holds_its_release_not_its_renewals() -> None:
    """`keep(..., maybe_until_ms)`: the lookup answered some time after it was sent, so a shard
    may have granted its lease as late as then plus the TTL asked. Renewals go by the early bound
    (due 10 s before it); the lease given back, or lapsing, is released up to the late one."""
    keeper = HintLeases(LeaseKeeping(lease_ttl_ms=30_000, renew_margin_ms=10_000, retry_ms=1_000))
    keeper.keep(NAMED, [LEASE], 30_000, now_ms=0, maybe_until_ms=32_000)
    keeper.check_invariants()
    assert keeper.due(19_999, lambda named: 300_000) == []
    (renewal,) = keeper.due(20_000, lambda named: 300_000)  # by the early bound
    keeper.renew_failed(renewal.lease, lost=False, now_ms=20_000)  # (never sent)
    keeper.give_back(NAMED, 30_500)  # past the early bound, before the late one
    (release,) = keeper.releases(30_500)
    assert release.lease == LEASE
    # a lapse (its hint's deadline reached, not renewed) before the late bound: released
    keeper = HintLeases(LeaseKeeping(lease_ttl_ms=30_000, renew_margin_ms=10_000, retry_ms=1_000))
    keeper.keep(NAMED, [LEASE], 30_000, now_ms=0, maybe_until_ms=32_000)
    assert keeper.due(30_000, lambda named: 30_000) == [] and keeper.leases_held == 0
    assert keeper.counters["leases_lost_total"] == 0 and keeper.releases_pending == 1
    keeper.check_invariants()

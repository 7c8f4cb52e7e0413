"""A segment re-verifies slots readers found corrupt (issue 22), within bounds: a bounded queue,
one report per slot pending, a slot found fine not re-hashed for a while (a flood of forged
reports of one good slot costs one hash), another tenant's object never hashed, a corrupt one
reported once, and nothing about an earlier incarnation."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, cast

from kvfabric.core.segment_slots import HeldSlot
from kvfabric.format.ids import DomainDigest
from kvfabric.proto.segment import VerifyRequest
from kvfabric.segment_storage.scrubber import CorruptObject
from kvfabric.segment_storage.suspects import (
    SUSPECTS_PENDING_MAX,
    SUSPECTS_PER_REPORTER_MAX,
    VERIFIED_OK_HOLD_S,
    SuspectChecker,
)

ALICE = DomainDigest(bytes(range(16)))
BOB = DomainDigest(bytes(range(1, 17)))


def key_of(domain: bytes) -> bytes:
    return bytes(4) + domain + bytes(76)  # the domain digest at [4:20], like a KVKey


class Backend:
    """Slots 0..99 stored (alice's); `corrupt` ones fail their re-hash; hashes counted."""

    def __init__(self, corrupt: set[int] | None = None, owner: bytes = ALICE) -> None:
        self.lock = threading.Lock()
        self.slots = self
        self.corrupt = corrupt or set()
        self.owner = owner
        self.hashed: list[int] = []

    def held_one(self, slot: int, generation: int) -> HeldSlot | None:
        return HeldSlot(slot, generation, 4096, b"c" * 16, key_of(self.owner)) if slot < 100 else None

    def verify_stored(self, slot: int, generation: int, size: int) -> str:
        self.hashed.append(slot)
        return "corrupt" if slot in self.corrupt else "ok"


def checker(backend: Backend, now: list[float]) -> tuple[SuspectChecker, list[CorruptObject]]:
    reported: list[CorruptObject] = []

    async def report(found: CorruptObject) -> None:
        reported.append(found)

    return SuspectChecker(cast(Any, backend), 7, report, clock_s=lambda: now[0]), reported


def request(slot: int, domains: tuple[DomainDigest, ...] = (ALICE,), incarnation: int = 7) -> VerifyRequest:
    return VerifyRequest(incarnation=incarnation, slot=slot, slot_generation=1, domains=list(domains))


async def settle(suspects: SuspectChecker) -> None:
    for _ in range(200):
        await asyncio.sleep(0.005)
        if suspects._worker is None or suspects._worker.done():
            return


def test_a_corrupt_slot_is_reported_once_and_a_good_one_hashed_once_per_hold() -> None:
    async def main() -> None:
        backend, now = Backend(corrupt={3}), [100.0]
        suspects, reported = checker(backend, now)
        assert suspects.suspect(request(3)) and not suspects.suspect(request(3))  # one pending
        await settle(suspects)
        assert [f.slot for f in reported] == [3]
        for _ in range(50):  # a flood of reports of a good slot
            suspects.suspect(request(5))
            await settle(suspects)
        assert backend.hashed.count(5) == 1
        now[0] += VERIFIED_OK_HOLD_S + 1
        assert suspects.suspect(request(5))
        await settle(suspects)
        assert backend.hashed.count(5) == 2

    asyncio.run(main())


def test_the_queue_is_bounded_and_foreign_or_stale_reports_hash_nothing() -> None:
    async def main() -> None:
        backend, now = Backend(corrupt=set(range(100))), [0.0]
        suspects, reported = checker(backend, now)
        reporters = [(ALICE, DomainDigest(bytes([i]) * 16)) for i in range(6)]  # 6 x 8 > 32
        queued = [suspects.suspect(request(s, reporters[s % 6])) for s in range(SUSPECTS_PENDING_MAX + 10)]
        assert queued.count(True) == SUSPECTS_PENDING_MAX and suspects.refused == 10
        await settle(suspects)
        assert len(reported) == SUSPECTS_PENDING_MAX
        backend.hashed.clear()
        assert suspects.suspect(request(60, domains=(BOB,)))  # bob about alice's object
        assert not suspects.suspect(request(61, incarnation=6))  # an earlier life of the segment
        assert suspects.suspect(request(150))  # nothing stored there
        await settle(suspects)
        assert backend.hashed == [] and len(reported) == SUSPECTS_PENDING_MAX

    asyncio.run(main())


def test_a_check_the_disk_tier_refuses_as_busy_is_tried_again() -> None:
    """Review, 2026-12-05: a disk read at the tier's in-flight byte limit raised `Busy` out of
    the check and ended the worker (the slots queued after it waited for another report)."""
    from unittest.mock import patch

    from kvfabric.format.errors import Busy
    from kvfabric.segment_storage import suspects as suspects_module

    class BusyOnce(Backend):
        def verify_stored(self, slot: int, generation: int, size: int) -> str:
            if slot == 3 and 3 not in self.hashed:
                self.hashed.append(slot)
                raise Busy("disk reads at their limit")
            return super().verify_stored(slot, generation, size)

    async def main() -> None:
        backend, now = BusyOnce(corrupt={3, 4}), [100.0]
        suspects, reported = checker(backend, now)
        assert suspects.suspect(request(3)) and suspects.suspect(request(4))
        await settle(suspects)
        assert sorted(f.slot for f in reported) == [3, 4]  # both checked, 3 a second time
        assert backend.hashed == [3, 4, 3] and suspects.busy_retries == 1

    with patch.object(suspects_module, "BUSY_RETRY_S", 0.0):
        asyncio.run(main())


def test_one_tenant_holds_at_most_its_share_of_the_queue() -> None:
    """Alice reporting her own (good) objects fills her share, not the queue: bob's report of a
    corrupt object of his is still queued and reported (review, 2026-12-06: 32 of alice's
    reports refused everyone else's until they were hashed)."""

    async def main() -> None:
        backend, now = Backend(corrupt={99}), [0.0]
        suspects, reported = checker(backend, now)
        queued = [suspects.suspect(request(s)) for s in range(SUSPECTS_PENDING_MAX)]
        assert queued.count(True) == SUSPECTS_PER_REPORTER_MAX < SUSPECTS_PENDING_MAX
        backend.owner = BOB  # (every slot is bob's from here: the check reads it when hashing)
        assert suspects.suspect(request(99, domains=(BOB,)))
        await settle(suspects)
        assert [f.slot for f in reported] == [99]
        assert not suspects._queued_by  # nothing kept per reporter once drained
        assert suspects.suspect(request(SUSPECTS_PENDING_MAX + 1))  # alice's share is free again
        await settle(suspects)
        # Reports with no domains (services; clients where tenants are off) are no tenant's: the
        # whole queue is theirs, not a share.
        untenanted = [suspects.suspect(request(s, domains=())) for s in range(SUSPECTS_PENDING_MAX)]
        assert all(untenanted)

    asyncio.run(main())


def test_checks_hash_at_most_the_byte_rate() -> None:
    """Reports of many distinct large objects kept the worker hashing (and reading the disk tier)
    back to back, outside any byte budget (review, stop 68): after each check it now waits its
    bytes' share of a second at `bytes_per_s`."""

    async def main() -> float:
        backend, now = Backend(), [100.0]

        async def report(found: CorruptObject) -> None:
            """None is corrupt here."""

        suspects = SuspectChecker(
            cast(Any, backend), 7, report, clock_s=lambda: now[0], bytes_per_s=4096 / 0.2
        )
        started = asyncio.get_running_loop().time()
        for slot in range(4):  # 4 objects of 4096 bytes at 4096 bytes per 0.2 s
            assert suspects.suspect(request(slot))
        assert suspects._worker is not None
        await asyncio.wait_for(suspects._worker, 10)
        assert backend.hashed == [0, 1, 2, 3]
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(main()) >= 0.75

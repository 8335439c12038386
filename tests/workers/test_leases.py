"""A run's lease kept while it runs: renewed every third of it, lost (and the run stopped) before
it can lapse unrenewed or once a renewal finds it taken, the run stopped when its work is told to
stop or the process shuts down."""

from __future__ import annotations

import asyncio
import threading
import time

from pagedbatch.workers.leases import STOP_CHECK_SECONDS, Lease

LEASE = 1.5  # seconds: a renewal due every 0.5 s, a look each STOP_CHECK_SECONDS


class Work:
    """What the lease looks at: its answers, and the renewals asked of it."""

    def __init__(self, renewed: bool = True, failing: bool = False) -> None:
        self.renewed = renewed
        self.failing = failing
        self.told_to_stop = False
        self.looks = 0
        self.renewals: list[float] = []

    def look(self, renew: bool) -> tuple[bool, bool]:
        self.looks += 1
        if self.failing:
            raise ConnectionError("the database is away")
        if renew:
            self.renewals.append(time.monotonic())
        return self.told_to_stop, renew and self.renewed


def lease_on(work: Work, renew_after_stop: bool = False, stopping=None) -> Lease:
    return Lease(
        "test work",
        time.monotonic() + LEASE,
        LEASE,
        work.look,
        stopping or threading.Event(),
        renew_after_stop,
    )


async def run_for(lease: Lease, seconds: float) -> None:
    async with lease.kept():
        try:
            async with asyncio.timeout(seconds):
                await lease.stop.wait()
        except TimeoutError:
            pass


def test_a_running_lease_is_renewed_every_third_of_it_and_never_lapses():
    work = Work()
    lease = lease_on(work)
    asyncio.run(run_for(lease, 2 * LEASE))  # past the lease it was claimed with
    assert not lease.stop.is_set() and not lease.lost
    assert 3 <= len(work.renewals) <= 2 * LEASE / STOP_CHECK_SECONDS
    assert lease.leased_until > time.monotonic()


def test_a_lease_that_cannot_be_renewed_is_lost_before_it_would_lapse():
    work = Work(failing=True)
    lease = lease_on(work)
    lapses_at = lease.leased_until
    asyncio.run(run_for(lease, 3 * LEASE))
    assert lease.lost and lease.stop.is_set()
    assert time.monotonic() < lapses_at
    assert work.looks <= LEASE / STOP_CHECK_SECONDS  # and it stopped looking


def test_a_renewal_that_finds_the_lease_taken_loses_it():
    lease = lease_on(Work(renewed=False))
    asyncio.run(run_for(lease, 2 * LEASE))
    assert lease.lost and lease.stop.is_set()


def test_work_told_to_stop_stops_the_run_and_is_looked_after_only_if_the_run_still_writes():
    for renew_after_stop in (False, True):
        work = Work()
        work.told_to_stop = True
        lease = lease_on(work, renew_after_stop)

        async def stopped_then_kept(lease: Lease = lease) -> None:
            async with lease.kept():
                await lease.stop.wait()
                await asyncio.sleep(2 * STOP_CHECK_SECONDS)

        asyncio.run(stopped_then_kept())
        assert lease.stop.is_set() and not lease.lost and not lease.handing_back
        if renew_after_stop:
            assert work.looks >= 2 and work.renewals
        else:
            assert work.looks == 1


def test_a_process_shutting_down_hands_the_work_back():
    stopping = threading.Event()
    stopping.set()
    lease = lease_on(Work(), stopping=stopping)
    asyncio.run(run_for(lease, LEASE))
    assert lease.stop.is_set() and lease.handing_back and not lease.lost

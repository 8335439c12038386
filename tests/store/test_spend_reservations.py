"""Spend reservations (store/reservations.py), on SQLite and PostgreSQL: processes reserving
against the same budgets at once never take one past its limit, settling moves the worst case out
and the actual cost in, and a killed holder's reservations go back to their budgets while a
living one's are kept."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import insert, select
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.ids import now
from pagedbatch.store.db import make_engine, make_session_factory, transaction
from pagedbatch.store.migrate import upgrade
from pagedbatch.store.models import SpendBudget, SpendLimit, SpendReservation, UsageRecord
from pagedbatch.store.reservations import (
    NANOS_PER_CENT,
    ORGANIZATION,
    Keeper,
    OverBudget,
    Settlement,
    key_scope,
    month_start,
    release_lapsed,
    settle,
)
from pagedbatch.store.usage import ALL_TIME, LedgerWriter, Usage, UsageQuery, usage_sums

REPO = Path(__file__).resolve().parents[2]


def nothing_before(_session: Session, _owner: str | None, _month: int) -> int:
    return 0


@pytest.fixture
def url(empty_database_url: str) -> str:
    upgrade(empty_database_url)
    return empty_database_url


@pytest.fixture
def sessions(url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(url)
    yield make_session_factory(engine)
    engine.dispose()


def budgets(sessions: sessionmaker[Session]) -> dict[str, tuple[int, int]]:
    """Each budget of this month: (spent, reserved)."""
    with sessions() as session:
        rows = session.scalars(select(SpendBudget).where(SpendBudget.month == month_start(now())))
        return {row.scope: (row.spent_nanos, row.reserved_nanos) for row in rows}


def reservations(sessions: sessionmaker[Session]) -> list[int]:
    with sessions() as session:
        return list(session.scalars(select(SpendReservation.nanos).order_by(SpendReservation.id)))


def set_service_limit(sessions: sessionmaker[Session], cents: int) -> None:
    with transaction(sessions) as session:
        session.add(
            SpendLimit(
                id=ORGANIZATION,
                threshold_cents=cents,
                currency="USD",
                interval="month",
                notification_channel=None,
            )
        )


# Each process reserves from several threads until its key's or the service's budget refuses,
# then settles what it took at its whole worst case, as requests that use all they may.
RESERVER = """
import json, sys, threading
from pagedbatch.store.db import make_engine, make_session_factory, transaction
from pagedbatch.store.reservations import Keeper, OverBudget, Settlement, settle

url, owners, nanos, key_limit, threads, attempts = sys.argv[1:7]
sessions = make_session_factory(make_engine(url))
keeper = Keeper(sessions, "reserver", 60, lambda *_: 0)
taken, refused = {}, {}
lock = threading.Lock()

def run(owner):
    for _ in range(int(attempts)):
        try:
            reservation = keeper.reserve(owner, int(nanos), int(key_limit))
        except OverBudget as over:
            with lock:
                refused[over.scope] = refused.get(over.scope, 0) + 1
            continue
        with transaction(sessions) as session:
            settle(session, [Settlement(reservation, reservation.nanos)])
        reservation.forget()
        with lock:
            taken[owner] = taken.get(owner, 0) + 1

workers = [
    threading.Thread(target=run, args=(owner,))
    for owner in owners.split(",") for _ in range(int(threads))
]
for worker in workers:
    worker.start()
for worker in workers:
    worker.join()
print(json.dumps({"taken": taken, "refused": refused}))
"""


def test_processes_reserving_at_once_never_take_a_budget_past_its_limit(url, sessions):
    """Four processes of four threads each (two per key) reserve a thousandth of a dollar at a
    time against keys limited to 0.6 cents and a service limited to a cent, until they are
    refused. Every reservation that went through is spent whole, so a check-then-write race
    would show as spend past a limit; without one the service's cent is spent exactly."""
    set_service_limit(sessions, 1)
    nanos, key_limit = NANOS_PER_CENT // 100, NANOS_PER_CENT * 6 // 10
    command = [sys.executable, "-c", RESERVER, url, "alice,bob", str(nanos), str(key_limit)]
    processes = [
        subprocess.Popen([*command, "2", "40"], stdout=subprocess.PIPE, cwd=REPO) for _ in range(4)
    ]
    reports = []
    for process in processes:
        out, _ = process.communicate(timeout=300)
        assert process.returncode == 0
        reports.append(json.loads(out))
    taken = {owner: sum(r["taken"].get(owner, 0) for r in reports) for owner in ("alice", "bob")}
    found = budgets(sessions)
    assert found[ORGANIZATION] == (NANOS_PER_CENT, 0)  # spent to the limit, nothing held
    for owner in ("alice", "bob"):
        assert found[key_scope(owner)] == (taken[owner] * nanos, 0)
        assert taken[owner] * nanos <= key_limit
    assert sum(taken.values()) == 100
    assert reservations(sessions) == []
    assert all(sum(r["refused"].values()) > 0 for r in reports)  # each process was refused


def test_a_reservation_past_either_limit_is_refused_and_settling_moves_worst_to_actual(sessions):
    set_service_limit(sessions, 1)  # 10^7 nano-dollars
    keeper = Keeper(sessions, "test", 60, nothing_before)
    first = keeper.reserve("alice", 6_000_000, 8_000_000)
    assert budgets(sessions) == {key_scope("alice"): (0, 6_000_000), ORGANIZATION: (0, 6_000_000)}
    with pytest.raises(OverBudget) as key_full:
        keeper.reserve("alice", 3_000_000, 8_000_000)
    assert key_full.value.scope == key_scope("alice")
    with pytest.raises(OverBudget) as service_full:
        keeper.reserve("bob", 5_000_000, None)
    assert service_full.value.scope == ORGANIZATION
    assert reservations(sessions) == [6_000_000]  # the refused ones left nothing behind

    with transaction(sessions) as session:
        settle(session, [Settlement(first, 2_000_000)])  # it used a third of its worst case
    first.forget()
    assert budgets(sessions)[ORGANIZATION] == (2_000_000, 0)
    second = keeper.reserve("bob", 5_000_000, None)  # room again
    assert budgets(sessions) == {
        key_scope("alice"): (2_000_000, 0),
        key_scope("bob"): (0, 5_000_000),
        ORGANIZATION: (2_000_000, 5_000_000),
    }
    keeper.release([second])
    assert budgets(sessions)[ORGANIZATION] == (2_000_000, 0)
    assert reservations(sessions) == []


def test_a_reservation_released_as_lapsed_still_counts_its_cost_when_it_settles(sessions):
    keeper = Keeper(sessions, "test", 60, nothing_before)
    reservation = keeper.reserve("alice", 900, None)
    reservation.forget()  # as if its holder were cut off: nothing renews it
    with transaction(sessions) as session:
        session.get(SpendReservation, reservation.id).expires_at = time.time() - 1
    assert release_lapsed(sessions) == 1
    assert budgets(sessions)[ORGANIZATION] == (0, 0)
    with transaction(sessions) as session:
        settle(session, [Settlement(reservation, 400)])
    assert budgets(sessions)[ORGANIZATION] == (400, 0)  # its worst case is not given back twice


HOLDER = """
import sys, time
from pagedbatch.store.db import make_engine, make_session_factory
from pagedbatch.store.reservations import Keeper

keeper = Keeper(make_session_factory(make_engine(sys.argv[1])), "doomed", 3, lambda *_: 0)
for _ in range(3):
    keeper.reserve("alice", 100, None)
print("held", flush=True)
time.sleep(600)
"""


def test_a_killed_holders_reservations_are_released_and_a_living_ones_kept(url, sessions):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        living = Keeper(sessions, "living", 3, nothing_before)
        mine = living.reserve("alice", 7, None)
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        assert budgets(sessions)[ORGANIZATION] == (0, 307)
        assert release_lapsed(sessions) == 0  # not lapsed yet
        # Upkeep, every half second, until the dead holder's three lapse (three seconds on).
        released = 0
        deadline = time.monotonic() + 60
        while released < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
            released += release_lapsed(sessions)
        assert released == 3
        for _ in range(8):  # two more leases' time: the living keeper renews its own
            time.sleep(0.5)
            assert release_lapsed(sessions) == 0
        assert budgets(sessions)[ORGANIZATION] == (0, 7)
        assert reservations(sessions) == [7]
        living.release([mine])
        assert budgets(sessions)[ORGANIZATION] == (0, 0)
    finally:
        holder.kill()
        holder.wait(30)


def test_the_ledger_writer_settles_a_request_with_its_record(sessions):
    keeper = Keeper(sessions, "test", 60, nothing_before)
    reservation = keeper.reserve("alice", 5_000, None)
    ledger = LedgerWriter(sessions)
    ledger.add(
        Usage(owner="alice", model="m", input_tokens=3, output_tokens=2),
        Settlement(reservation, 1_234),
    )
    ledger.add(None, Settlement(keeper.reserve("bob", 700, None), 0))  # it used nothing
    ledger.close()
    with sessions() as session:
        assert session.scalars(select(UsageRecord.owner)).all() == ["alice"]
    assert budgets(sessions) == {
        key_scope("alice"): (1_234, 0),
        key_scope("bob"): (0, 0),
        ORGANIZATION: (1_234, 0),
    }
    assert reservations(sessions) == []


def test_a_months_budget_opens_with_what_the_ledger_holds_of_the_month(sessions):
    """A deployment that had usage before budgets existed: each key's and the service's budget
    starts from the month's ledger records (here 10 nano-dollars an output token)."""
    this_month = month_start(now())
    record = {"model": "m", "input_tokens": 0, "cached_tokens": 0}
    record |= {"image_tokens": 0, "audio_tokens": 0}
    with transaction(sessions) as session:
        session.execute(
            insert(UsageRecord),
            [
                {**record, "owner": "alice", "output_tokens": 30, "finished_at": this_month},
                {**record, "owner": "bob", "output_tokens": 20, "finished_at": now()},
                {**record, "owner": "alice", "output_tokens": 99, "finished_at": this_month - 1},
            ],
        )

    def opening(session: Session, owner: str | None, month: int) -> int:
        query = UsageQuery(
            start=month,
            end=month + ALL_TIME,
            width=ALL_TIME,
            owners=None if owner is None else frozenset({owner}),
        )
        return sum(10 * sums.output_tokens for sums in usage_sums(session, query))

    Keeper(sessions, "test", 60, opening).reserve("alice", 1, None)
    assert budgets(sessions) == {key_scope("alice"): (300, 1), ORGANIZATION: (500, 1)}

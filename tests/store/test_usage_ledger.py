"""The usage ledger: the realtime writer commits records a batch at a time and rides out a
database outage without losing or repeating one; the sums group and bucket them as asked."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from services import postgres_schema
from sqlalchemy import insert, make_url, select
from sqlalchemy.orm import Session, sessionmaker
from tcp_proxy import TcpProxy

from pagedbatch.store.db import make_engine, make_session_factory, transaction
from pagedbatch.store.migrate import upgrade
from pagedbatch.store.models import UsageRecord
from pagedbatch.store.usage import LedgerWriter, Usage, UsageQuery, usage_sums


@pytest.fixture
def sessions(empty_database_url: str) -> Iterator[sessionmaker[Session]]:
    upgrade(empty_database_url)
    engine = make_engine(empty_database_url)
    yield make_session_factory(engine)
    engine.dispose()


def records(sessions: sessionmaker[Session]) -> list[tuple[str, int]]:
    with sessions() as session:
        return list(session.execute(select(UsageRecord.owner, UsageRecord.output_tokens)))


def test_the_writer_commits_what_it_was_given(sessions):
    ledger = LedgerWriter(sessions)
    for i in range(5):
        ledger.add(Usage(owner=f"t{i % 2}", model="m", input_tokens=10, output_tokens=i))
    ledger.close()
    assert sorted(records(sessions)) == [("t0", 0), ("t0", 2), ("t0", 4), ("t1", 1), ("t1", 3)]


def test_the_writer_rides_out_a_database_outage(postgres_url, caplog):
    with postgres_schema(postgres_url) as url:
        upgrade(url)
        direct = make_engine(url)
        address = make_url(url)
        proxy = TcpProxy(address.host or "127.0.0.1", address.port or 5432)
        through = make_engine(address.set(port=proxy.port).render_as_string(hide_password=False))
        try:
            ledger = LedgerWriter(make_session_factory(through))
            with proxy.outage():
                ledger.add(Usage(owner="t", model="m", input_tokens=1, output_tokens=7))
                time.sleep(2.5)  # two flushes fail
                assert records(make_session_factory(direct)) == []
            ledger.add(Usage(owner="t", model="m", input_tokens=1, output_tokens=8))
            ledger.close()
            assert sorted(records(make_session_factory(direct))) == [("t", 7), ("t", 8)]
            assert "writing 1 records failed" in caplog.text  # the outage was felt
        finally:
            through.dispose()
            direct.dispose()
            proxy.close()


def test_sums_by_bucket_and_group(sessions):
    rows = [
        {"owner": "a", "model": "m", "batch_id": None, "finished_at": 100},
        {"owner": "a", "model": "m", "batch_id": "b1", "finished_at": 119},
        {"owner": "b", "model": "n", "batch_id": None, "finished_at": 120},
        {"owner": "a", "model": "m", "batch_id": None, "finished_at": 180},  # past the end
    ]
    tokens = {"input_tokens": 3, "cached_tokens": 1, "output_tokens": 2}
    with transaction(sessions) as session:
        session.execute(
            insert(UsageRecord),
            [{**row, **tokens, "image_tokens": 0, "audio_tokens": 0} for row in rows],
        )
        query = UsageQuery(start=100, end=180, width=60, group_by=frozenset({"batch"}))
        found = usage_sums(session, query)
        mine = usage_sums(session, UsageQuery(start=0, end=200, width=60, owners=frozenset("b")))
    assert [(s.bucket, s.batch, s.requests, s.input_tokens) for s in found] == [
        (60, False, 1, 3),
        (60, True, 1, 3),
        (120, False, 1, 3),
    ]
    assert [(s.bucket, s.requests, s.model, s.api_key_id) for s in mine] == [(120, 1, None, None)]

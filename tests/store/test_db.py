"""The models work the same on SQLite and PostgreSQL, on the schema the migrations build."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from pagedbatch.ids import new_id
from pagedbatch.store.db import make_engine, make_session_factory, transaction
from pagedbatch.store.migrate import upgrade
from pagedbatch.store.models import (
    Batch,
    BatchRequest,
    BatchStatus,
    RequestStatus,
    Shard,
    ShardStatus,
)


@pytest.fixture
def sessions(empty_database_url: str) -> Iterator[sessionmaker[Session]]:
    upgrade(empty_database_url)
    engine = make_engine(empty_database_url)
    yield make_session_factory(engine)
    engine.dispose()


def make_batch(**values: object) -> Batch:
    return Batch(
        id=new_id("batch_"),
        owner="default",
        endpoint="/v1/chat/completions",
        input_file_id=new_id("file-"),
        completion_window="24h",
        status=BatchStatus.VALIDATING,
        **values,
    )


def make_request(batch: Batch, line: int, custom_id: str) -> BatchRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"say {line}"}]}
    return BatchRequest(batch_id=batch.id, line=line, custom_id=custom_id, shard_index=0, body=body)


def test_a_batch_with_shards_and_requests_round_trips(sessions: sessionmaker[Session]) -> None:
    batch = make_batch(metadata_={"project": "x"}, model="tiny")
    with transaction(sessions) as session:
        session.add(batch)
        session.add(Shard(batch_id=batch.id, owner=batch.owner, index=0))
        session.add_all(make_request(batch, line, f"req-{line}") for line in (1, 2, 3))

    with sessions() as session:
        stored = session.get_one(Batch, batch.id)
        assert stored.metadata_ == {"project": "x"}
        assert stored.created_at > 0
        assert (stored.request_total, stored.request_completed, stored.input_tokens) == (0, 0, 0)

        shard = session.scalars(select(Shard).where(Shard.batch_id == batch.id)).one()
        assert (shard.status, shard.attempts, shard.lease_owner) == (ShardStatus.PENDING, 0, None)

        requests = session.scalars(
            select(BatchRequest).where(BatchRequest.batch_id == batch.id).order_by("line")
        ).all()
        assert [r.custom_id for r in requests] == ["req-1", "req-2", "req-3"]
        assert requests[1].body["messages"][0]["content"] == "say 2"
        assert {r.status for r in requests} == {RequestStatus.PENDING}
        assert requests[0].result is None


def test_custom_id_is_unique_within_a_batch_only(sessions: sessionmaker[Session]) -> None:
    first, second = make_batch(), make_batch()
    with transaction(sessions) as session:
        session.add_all([first, second])
        session.add(make_request(first, 1, "same"))
        session.add(make_request(second, 1, "same"))

    with pytest.raises(IntegrityError), transaction(sessions) as session:
        session.add(make_request(first, 2, "same"))

    with sessions() as session:
        count = session.scalar(select(func.count()).select_from(BatchRequest))
        assert count == 2


def test_deleting_a_batch_deletes_its_shards_and_requests(
    sessions: sessionmaker[Session],
) -> None:
    batch = make_batch()
    with transaction(sessions) as session:
        session.add(batch)
        session.add(Shard(batch_id=batch.id, owner=batch.owner, index=0))
        session.add(make_request(batch, 1, "a"))

    with transaction(sessions) as session:
        # A bulk delete, as the database's ON DELETE CASCADE must do the work, not the ORM.
        session.execute(Batch.__table__.delete().where(Batch.__table__.c.id == batch.id))

    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Shard)) == 0
        assert session.scalar(select(func.count()).select_from(BatchRequest)) == 0

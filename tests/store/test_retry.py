"""Which failures are outages, told apart on real errors from real drivers, and how `retrying`
rides them out: a transient error is retried until the deadline, anything else passes at once."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import boto3
import pytest
import redis
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError, EndpointConnectionError
from services import S3Server, postgres_schema
from sqlalchemy import Engine, text
from sqlalchemy.exc import DataError, IntegrityError, OperationalError, ProgrammingError

from pagedbatch.store.db import make_engine
from pagedbatch.store.retry import backoff, is_transient, retrying


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def raised(operation: Callable[[], object]) -> BaseException:
    with pytest.raises(Exception) as caught:
        operation()
    return caught.value


@pytest.fixture
def database(postgres_url: str) -> Iterator[Engine]:
    with postgres_schema(postgres_url) as url:
        engine = make_engine(url)
        yield engine
        engine.dispose()


def test_a_database_that_cannot_be_reached_is_transient():
    engine = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/test")
    error = raised(lambda: engine.connect())
    assert isinstance(error, OperationalError) and is_transient(error)


def test_a_connection_the_server_dropped_is_transient(database: Engine):
    with database.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
        with database.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        error = raised(lambda: conn.execute(text("SELECT 1")))
    assert is_transient(error)


def test_errors_in_the_statement_or_the_data_are_not_transient(database: Engine):
    with database.begin() as conn:
        conn.execute(text("CREATE TABLE t (id int PRIMARY KEY)"))
        conn.execute(text("INSERT INTO t VALUES (1)"))
    for statement, kind in (
        ("INSERT INTO t VALUES (1)", IntegrityError),
        ("SELEC 1", ProgrammingError),
        ("SELECT 1 / 0", DataError),
    ):
        with database.connect() as conn:
            error = raised(lambda s=statement, c=conn: c.execute(text(s)))
        assert isinstance(error, kind) and not is_transient(error), statement


def s3_client(endpoint_url: str, server: S3Server) -> object:
    return boto3.session.Session(
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
    ).client(
        "s3",
        endpoint_url=endpoint_url,
        config=BotoConfig(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}),
    )


def test_s3_out_of_reach_is_transient_and_a_missing_bucket_is_not(s3_server: S3Server):
    unreachable = s3_client(f"http://127.0.0.1:{closed_port()}", s3_server)
    error = raised(lambda: unreachable.head_bucket(Bucket="any"))
    assert isinstance(error, EndpointConnectionError) and is_transient(error)
    reachable = s3_client(s3_server.endpoint_url, s3_server)
    error = raised(lambda: reachable.get_object(Bucket="no-such-bucket-here", Key="k"))
    assert isinstance(error, ClientError) and not is_transient(error)


def test_a_broker_out_of_reach_and_a_refused_socket_are_transient():
    broker = redis.Redis(port=closed_port(), socket_connect_timeout=1)
    assert is_transient(raised(broker.ping))
    assert is_transient(raised(lambda: socket.create_connection(("127.0.0.1", closed_port()))))
    assert not is_transient(ValueError("a bug"))


def refused() -> None:
    socket.create_connection(("127.0.0.1", closed_port())).close()


def test_retrying_rides_out_transient_failures():
    calls, waits = [], []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            refused()
        return "done"

    assert retrying(flaky, "a flaky call", sleep=waits.append) == "done"
    assert len(calls) == 3
    assert len(waits) == 2 and all(0 < wait <= 5.0 for wait in waits)


def test_retrying_gives_up_at_the_deadline_with_the_last_error():
    calls = []

    def down() -> None:
        calls.append(1)
        refused()

    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError):
        retrying(down, "an unreachable service", deadline_seconds=0.5)
    took = time.monotonic() - started
    assert 0.5 <= took < 0.5 + 5.0  # the deadline, plus at most the last wait
    assert len(calls) >= 2


def test_retrying_lets_other_errors_through_at_once():
    calls, waits = [], []

    def broken() -> None:
        calls.append(1)
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        retrying(broken, "a broken call", sleep=waits.append)
    assert (len(calls), waits) == (1, [])


def test_backoff_grows_with_jitter_to_a_ceiling():
    for attempt, ceiling in ((0, 0.2), (1, 0.4), (3, 1.6), (10, 5.0), (50, 5.0)):
        waits = [backoff(attempt) for _ in range(50)]
        assert all(ceiling / 2 <= wait <= ceiling for wait in waits)
        assert len(set(waits)) > 1

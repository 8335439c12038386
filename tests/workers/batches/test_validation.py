"""Validating batch input files on a real job store: bounded error reports, line errors for what
the database cannot hold, chunked commits that stay all or nothing, and outages that never fail
a batch. The validation task runs directly; the tasks it queues are recorded, not run.

The checks of single lines through the whole service are in tests/api/test_batches.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing
from typing import Any

import pytest
from services import postgres_schema
from sqlalchemy import func, make_url, select, text
from tcp_proxy import TcpProxy

from pagedbatch.ids import new_id, now
from pagedbatch.protocol.batch_lines import LongLine
from pagedbatch.service import open_store
from pagedbatch.settings import Settings
from pagedbatch.store.batches import transition
from pagedbatch.store.db import transaction
from pagedbatch.store.models import Batch, BatchRequest, BatchStatus, File, RequestStatus, Shard
from pagedbatch.store.queue import InProcessQueue
from pagedbatch.workers.batches.validation import iter_lines, validate_batch
from pagedbatch.workers.context import WorkerContext


class Validator:
    """A worker context on a fresh job store, and the tasks validation queued."""

    def __init__(self, settings: Settings):
        session_factory, blobs = open_store(settings)
        self.queued: list[str] = []
        self.queue = InProcessQueue(lambda name, args: self.queued.append(name))
        self.ctx = WorkerContext(settings, session_factory, blobs, queue=self.queue)

    def batch(self, lines: list[dict | str]) -> str:
        """A validating batch of `lines`; returns its id."""
        content = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
        data = content.encode()
        file_id, batch_id = new_id("file-"), new_id("batch_")
        self.ctx.blobs.put(f"files/{file_id}", [data])
        with transaction(self.ctx.session_factory) as session:
            session.add(
                File(
                    id=file_id,
                    owner="default",
                    filename="input.jsonl",
                    purpose="batch",
                    bytes=len(data),
                    storage_key=f"files/{file_id}",
                )
            )
            session.add(
                Batch(
                    id=batch_id,
                    owner="default",
                    endpoint="/v1/chat/completions",
                    input_file_id=file_id,
                    completion_window="24h",
                    status="validating",
                    created_at=now(),
                )
            )
        return batch_id

    def get(self, batch_id: str) -> Batch:
        with self.ctx.session_factory() as session:
            return session.get(Batch, batch_id)

    def requests(self, batch_id: str) -> dict[str, int]:
        """The batch's request rows, counted by status."""
        with self.ctx.session_factory() as session:
            rows = session.execute(
                select(BatchRequest.status, func.count())
                .where(BatchRequest.batch_id == batch_id)
                .group_by(BatchRequest.status)
            ).all()
        return dict(rows)


@pytest.fixture
def make_validator(tmp_path, request) -> Iterator[Any]:
    """`make_validator(storage="sqlite", **settings)`: a `Validator` on SQLite or PostgreSQL."""
    with ExitStack() as cleanup:

        def make(storage: str = "sqlite", **settings: Any) -> Validator:
            if storage == "postgresql":
                url = request.getfixturevalue("postgres_url")
                settings["database_url"] = cleanup.enter_context(postgres_schema(url))
            validator = Validator(Settings(data_dir=tmp_path / "data", **settings))
            # Run first (last in, first out): the schema is dropped once nothing holds it.
            cleanup.callback(validator.ctx.session_factory.kw["bind"].dispose)
            cleanup.callback(validator.queue.shutdown)
            return validator

        yield make


def line(custom_id: str, **fields: Any) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]},
        **fields,
    }


@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
def test_a_valid_file_moves_to_in_progress_with_every_request_pending(make_validator, storage):
    validator = make_validator(storage, shard_size=400)
    batch_id = validator.batch([line(f"r{i}") for i in range(2500)])
    validate_batch(validator.ctx, batch_id)

    batch = validator.get(batch_id)
    assert batch.status == "in_progress" and batch.request_total == 2500
    assert validator.requests(batch_id) == {"pending": 2500}
    with validator.ctx.session_factory() as session:
        shards = session.scalars(select(Shard.index).where(Shard.batch_id == batch_id)).all()
    assert sorted(shards) == list(range(7))
    time.sleep(0.2)  # the recording queue runs on threads
    assert validator.queued == ["run_shard"] * 7


def test_errors_are_capped_and_echoed_values_cut(make_validator):
    validator = make_validator()
    huge = "G" * 20_000  # echoed by the invalid_method message
    batch_id = validator.batch([line(f"r{i}", method=huge) for i in range(300)])
    validate_batch(validator.ctx, batch_id)

    batch = validator.get(batch_id)
    assert batch.status == "failed"
    assert len(batch.errors) == 100
    assert [error["line"] for error in batch.errors] == list(range(1, 101))
    assert all(error["code"] == "invalid_method" for error in batch.errors)
    assert all(len(error["message"]) <= 500 for error in batch.errors)
    assert batch.errors[0]["message"].startswith("method must be POST, got 'GGG")
    assert batch.errors[0]["message"].endswith("…")
    assert len(json.dumps(batch.errors)) < 60_000
    assert validator.requests(batch_id) == {}


@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
def test_a_custom_id_longer_than_its_column_is_that_lines_error(make_validator, storage):
    validator = make_validator(storage)
    batch_id = validator.batch([line("a" * 512), line("b" * 513), line("c")])
    validate_batch(validator.ctx, batch_id)

    batch = validator.get(batch_id)
    assert batch.status == "failed"
    assert batch.errors == [
        {
            "code": "invalid_value",
            "message": "custom_id has 513 characters; at most 512 are allowed.",
            "param": "custom_id",
            "line": 2,
        }
    ]
    assert validator.requests(batch_id) == {}


def test_a_line_nested_too_deeply_to_parse_is_that_lines_error_saying_so(make_validator):
    validator = make_validator()
    # Nesting this deep makes the JSON parser raise RecursionError, not a ValueError.
    batch_id = validator.batch([line("a"), "[" * 100_000, line("c")])
    validate_batch(validator.ctx, batch_id)

    batch = validator.get(batch_id)
    assert batch.status == "failed"
    [error] = batch.errors
    assert (error["code"], error["line"], error["param"]) == ("invalid_json_line", 2, None)
    assert "nests more than 500 levels deep" in error["message"]


def test_requests_are_committed_in_chunks_and_a_late_bad_line_removes_them(make_validator):
    """SQLite has one writer: a write must not wait for a whole file's validation."""
    validator = make_validator()
    lines = [line(f"r{i}") for i in range(20_000)] + ["not json"]
    batch_id = validator.batch(lines)
    seen: list[dict[str, int]] = []  # the batch's requests as others saw them meanwhile
    waits: list[float] = []
    validating = threading.Thread(target=validate_batch, args=(validator.ctx, batch_id))
    began = time.monotonic()
    validating.start()
    try:
        while validating.is_alive():
            started = time.monotonic()
            with transaction(validator.ctx.session_factory) as session:
                session.execute(text("UPDATE files SET status = 'processed'"))
            waits.append(time.monotonic() - started)
            if validator.get(batch_id).status == "validating":
                seen.append(validator.requests(batch_id))
            time.sleep(0.02)
    finally:
        validating.join()
    validation_s = time.monotonic() - began

    assert max(counts.get("staged", 0) for counts in seen) >= 1000
    assert all(set(counts) <= {"staged"} for counts in seen)  # invisible to shards meanwhile
    # A write waits for one chunk's commit, not the whole file's validation. Bounded by a share of
    # the validation, not by seconds: a loaded machine stretches both alike (one fsync took 1.1 s
    # in CI), while a lock held for the whole file would make some wait nearly all of it.
    assert len(waits) >= 3
    assert max(waits) < validation_s / 2, f"a write waited {max(waits):.1f} of {validation_s:.1f} s"
    batch = validator.get(batch_id)
    assert batch.status == "failed" and [e["line"] for e in batch.errors] == [20_001]
    assert validator.requests(batch_id) == {}  # all or nothing


def test_a_cancel_during_validation_stages_nothing_for_finalization(make_validator):
    validator = make_validator()
    batch_id = validator.batch([line(f"r{i}") for i in range(20_000)])
    validating = threading.Thread(target=validate_batch, args=(validator.ctx, batch_id))
    validating.start()
    deadline = time.monotonic() + 10
    while not validator.requests(batch_id):  # a first chunk is staged
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with transaction(validator.ctx.session_factory) as session:  # as POST .../cancel does
        assert transition(session, batch_id, BatchStatus.CANCELLING)
    validating.join()

    assert validator.requests(batch_id) == {}
    assert validator.get(batch_id).status == "cancelling"
    time.sleep(0.2)
    assert validator.queued == ["finalize_batch"]


def test_a_rerun_after_a_crash_builds_on_the_staged_rows(make_validator):
    validator = make_validator(shard_size=1000)
    batch_id = validator.batch([line(f"r{i}") for i in range(3000)])
    with transaction(validator.ctx.session_factory) as session:  # what a crashed run left
        session.execute(
            BatchRequest.__table__.insert(),
            [
                {
                    "batch_id": batch_id,
                    "line": i + 1,
                    "custom_id": f"r{i}",
                    "shard_index": i // 1000,
                    "body": line(f"r{i}")["body"],
                    "status": RequestStatus.STAGED,
                }
                for i in range(1500)
            ],
        )
    validate_batch(validator.ctx, batch_id)
    assert validator.get(batch_id).status == "in_progress"
    assert validator.requests(batch_id) == {"pending": 3000}


def test_a_database_outage_never_fails_the_batch(postgres_url, tmp_path):
    url = make_url(postgres_url)
    with (
        postgres_schema(postgres_url) as schema_url,
        closing(TcpProxy(url.host, url.port)) as relay,
    ):
        relayed = make_url(schema_url).set(host="127.0.0.1", port=relay.port)
        validator = Validator(
            Settings(
                data_dir=tmp_path,
                database_url=relayed.render_as_string(hide_password=False),
                validation_outage_seconds=1.0,
            )
        )
        try:
            batch_id = validator.batch([line(f"r{i}") for i in range(10)])
            relay.cut()
            validate_batch(validator.ctx, batch_id)
            relay.restore()
            # The outage outlasted the retries: left for upkeep to queue again, not failed.
            assert validator.get(batch_id).status == "validating"

            # A shorter one is ridden out.
            relay.cut()
            validating = threading.Thread(target=validate_batch, args=(validator.ctx, batch_id))
            validating.start()
            time.sleep(0.3)
            relay.restore()
            validating.join()
            assert validator.get(batch_id).status == "in_progress"
            assert validator.requests(batch_id) == {"pending": 10}
        finally:
            validator.queue.shutdown()
            validator.ctx.session_factory.kw["bind"].dispose()


def test_lines_are_split_holding_at_most_a_lines_bound_of_any_line():
    data = b"a" * 10 + b"\n" + b"b" * 5000 + b"\n\nc"
    chunks = [data[i : i + 64] for i in range(0, len(data), 64)]
    assert list(iter_lines(chunks, 100)) == [b"a" * 10, LongLine(b"b" * 100, 5000), b"", b"c"]


@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
def test_a_line_past_the_body_bound_fails_alone_without_an_engine(make_validator, storage):
    """No engine in this process: a long line is refused all the same (it needs none), its body
    not kept; the other lines are staged for the shards."""
    validator = make_validator(storage, max_request_body_bytes=4096)
    big = line("big")
    big["body"]["messages"][0]["content"] = "x" * 10_000
    batch_id = validator.batch([line("a"), big, line("c")])
    validate_batch(validator.ctx, batch_id)

    batch = validator.get(batch_id)
    assert (batch.status, batch.request_total, batch.request_failed) == ("in_progress", 3, 1)
    assert validator.requests(batch_id) == {"pending": 2, "failed": 1}
    with validator.ctx.session_factory() as session:
        row = session.scalars(
            select(BatchRequest).where(
                BatchRequest.batch_id == batch_id, BatchRequest.custom_id == "big"
            )
        ).one()
    assert row.body == {}
    response = row.result["response"]
    assert response["status_code"] == 413
    assert response["body"]["error"]["code"] == "request_too_large"


def test_a_long_line_whose_custom_id_is_past_its_head_fails_the_batch(make_validator):
    validator = make_validator(max_request_body_bytes=4096)
    big = line("big")
    big["body"]["messages"][0]["content"] = "x" * 10_000
    body_first = json.dumps({"body": big.pop("body"), **big})
    batch_id = validator.batch([line("a"), body_first])
    validate_batch(validator.ctx, batch_id)

    batch = validator.get(batch_id)
    assert batch.status == "failed"
    [error] = batch.errors
    assert (error["code"], error["line"]) == ("line_too_large", 2)
    assert "more than the 4096 a line may have" in error["message"]
    assert validator.requests(batch_id) == {}

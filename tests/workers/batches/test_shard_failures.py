"""A bad line fails alone, and a shard that keeps failing its workers is retired, not retried
for ever: its batch still ends, with every line in exactly one file."""

from __future__ import annotations

import time
from typing import Any

from batch_worker import (
    batch,
    chat_line,
    finalized,
    pending_requests,
    run_all_shards,
    shard_states,
    submit,
)
from sqlalchemy import update

from pagedbatch.ids import now
from pagedbatch.protocol.batch_lines import MAX_ERROR_TEXT
from pagedbatch.store.db import transaction
from pagedbatch.store.models import Batch, BatchStatus, Shard, ShardStatus
from pagedbatch.workers.batches.shards import claim_shard


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def wait_for_finalization(worker, batch_id: str, timeout: float = 5.0) -> bool:
    """Whether the worker asked for the batch's finalization (the queue records it in a thread)."""
    deadline = time.monotonic() + timeout
    while ("finalize_batch", (batch_id,)) not in worker.queued:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def assert_error_response(line: dict[str, Any]) -> dict[str, Any]:
    response = line["response"]
    assert line["error"] is None and response["status_code"] in (400, 500)
    error = response["body"]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if response["status_code"] == 500:  # nothing checked for it: the line failed unexpectedly
        assert error["type"] == "server_error"
        assert error["message"] == "The server had an error while processing this request."
    return error


def test_lines_that_break_preparation_fail_alone_and_the_rest_run(make_batch_worker):
    worker = make_batch_worker()
    lines = [
        chat_line("ok-1"),
        chat_line("huge-bias-key", logit_bias={"-100000000000000000000000": 1}),
        chat_line(
            "deep-schema",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "deep", "schema": nested_schema(300)},
            },
        ),
        chat_line("ok-2"),
    ]
    batch_id = submit(worker, lines)
    run_all_shards(worker, batch_id)  # before: the first bad line crashed the shard
    assert wait_for_finalization(worker, batch_id)
    ended, results = finalized(worker, batch_id)
    assert ended.status == BatchStatus.COMPLETED
    assert (ended.request_completed, ended.request_failed) == (2, 2)
    for custom_id in ("ok-1", "ok-2"):
        assert results[custom_id]["response"]["status_code"] == 200
    for custom_id in ("huge-bias-key", "deep-schema"):
        assert_error_response(results[custom_id])


def test_error_lines_quote_a_bounded_part_of_the_input(make_batch_worker):
    worker = make_batch_worker()
    huge_name = "x" * 100_000
    batch_id = submit(worker, [chat_line("unknown", **{huge_name: 1}), chat_line("ok")])
    run_all_shards(worker, batch_id)
    ended, results = finalized(worker, batch_id)
    error = assert_error_response(results["unknown"])
    # Still says what is wrong, without copying the 100,000 characters three times over.
    assert error["code"] == "unknown_parameter"
    assert error["message"].startswith("Unrecognized request argument supplied: xxx")
    for text in (error["message"], error["param"]):
        assert len(text) < MAX_ERROR_TEXT + 40 and text.endswith("more characters)")
    assert results["ok"]["response"]["status_code"] == 200


def crash(worker, batch_id: str) -> None:
    """What the reaper does once a crashed worker's lease lapses: the shard is pending again."""
    with transaction(worker.ctx.session_factory) as session:
        session.execute(
            update(Shard)
            .where(Shard.batch_id == batch_id)
            .values(status=ShardStatus.PENDING, lease_owner=None, lease_expires_at=None)
        )


def test_a_shard_out_of_attempts_fails_its_lines_and_the_search_goes_on(make_batch_worker):
    worker = make_batch_worker(max_shard_attempts=2)
    poisonous = submit(worker, [chat_line("p1"), chat_line("p2")])
    healthy = submit(worker, [chat_line("h1")])
    with transaction(worker.ctx.session_factory) as session:  # older: claimed first
        session.execute(update(Batch).where(Batch.id == poisonous).values(created_at=now() - 60))
    for _ in range(2):  # each claim of the older batch's shard ends in a crash
        claimed = claim_shard(worker.ctx)
        assert claimed is not None and claimed.batch_id == poisonous
        crash(worker, poisonous)
    # The third claim retires the poisonous shard and takes the next one.
    claimed = claim_shard(worker.ctx)
    assert claimed is not None and claimed.batch_id == healthy
    assert shard_states(worker, poisonous) == [ShardStatus.DONE]
    assert pending_requests(worker, poisonous) == 0
    assert wait_for_finalization(worker, poisonous)
    ended, results = finalized(worker, poisonous)
    assert ended.status == BatchStatus.COMPLETED
    assert (ended.request_completed, ended.request_failed) == (0, 2)
    for custom_id in ("p1", "p2"):
        line = results[custom_id]
        assert line["response"] is None and line["id"].startswith("batch_req_")
        assert line["error"]["code"] == "shard_failed"
        assert "tried 2 times" in line["error"]["message"]
    assert batch(worker, healthy).status == BatchStatus.IN_PROGRESS

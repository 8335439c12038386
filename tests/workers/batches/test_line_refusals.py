"""Lines the endpoint would refuse (a prompt past the context, a bad parameter) are refused while
the batch is validated, when the validating worker has the engine: each fails alone with the 400
the endpoint answers, counted at once, before any engine work, and the batch goes on."""

from __future__ import annotations

import json

from batch_worker import (
    batch,
    chat_line,
    finalized,
    pending_requests,
    run_all_shards,
    shard_states,
    submit,
)
from sqlalchemy import select

from pagedbatch.store.models import BatchRequest, BatchStatus


def too_long(worker, custom_id: str) -> dict:
    limit = worker.ctx.engine.engine.max_model_len
    return chat_line(custom_id, messages=[{"role": "user", "content": "word " * limit}])


def test_refused_lines_fail_at_validation_and_the_rest_runs(make_batch_worker):
    worker = make_batch_worker()
    engine = worker.ctx.engine.engine
    limit = engine.max_model_len
    tokens_run = engine.get_stats()["batched_tokens"]
    lines = [
        chat_line("ok-1"),
        too_long(worker, "long"),
        chat_line("hot", temperature=3),
        chat_line("ok-2"),
    ]
    batch_id = submit(worker, lines)
    # Validated, no shard run yet: the two refused lines are already failed and counted.
    validated = batch(worker, batch_id)
    assert (validated.request_total, validated.request_failed) == (4, 2)
    assert pending_requests(worker, batch_id) == 2
    assert engine.get_stats()["batched_tokens"] == tokens_run

    run_all_shards(worker, batch_id)
    ended, results = finalized(worker, batch_id)
    assert ended.status == BatchStatus.COMPLETED
    assert (ended.request_completed, ended.request_failed) == (2, 2)
    assert results["ok-1"]["response"]["status_code"] == 200
    assert results["ok-2"]["response"]["status_code"] == 200
    long = results["long"]["response"]
    assert long["status_code"] == 400
    assert long["body"]["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens" in long["body"]["error"]["message"]
    hot = results["hot"]["response"]
    assert (hot["status_code"], hot["body"]["error"]["param"]) == (400, "temperature")


def test_a_batch_of_refused_lines_needs_no_shard(make_batch_worker):
    worker = make_batch_worker()
    batch_id = submit(worker, [too_long(worker, "a"), too_long(worker, "b")])
    assert shard_states(worker, batch_id) == []
    assert ("finalize_batch", (batch_id,)) in worker.queued
    ended, results = finalized(worker, batch_id)
    assert ended.status == BatchStatus.COMPLETED
    assert (ended.request_completed, ended.request_failed) == (0, 2)
    assert ended.output_file_id is None
    assert {line["response"]["status_code"] for line in results.values()} == {400}


def test_a_line_past_the_body_bound_fails_alone_unread_and_the_rest_runs(make_batch_worker):
    """A line is held to a realtime body's bound (max_request_body_bytes): past it, it fails with
    the 413 the endpoint answers such a body, its body neither parsed nor kept."""
    bound = 64 * 2**10
    worker = make_batch_worker(max_request_body_bytes=bound)
    # 30 messages, each far inside a text field's bound, together past the line's.
    messages = [{"role": "user", "content": "word " * 600} for _ in range(30)]
    huge = chat_line("huge", messages=messages)
    assert len(json.dumps(huge)) > bound
    batch_id = submit(worker, [chat_line("ok-1"), huge, chat_line("ok-2")])
    validated = batch(worker, batch_id)
    assert (validated.request_total, validated.request_failed) == (3, 1)
    assert request_body(worker, batch_id, "huge") == {}  # not kept

    run_all_shards(worker, batch_id)
    ended, results = finalized(worker, batch_id)
    assert (ended.request_completed, ended.request_failed) == (2, 1)
    assert results["ok-1"]["response"]["status_code"] == 200
    assert results["ok-2"]["response"]["status_code"] == 200
    refused = results["huge"]["response"]
    assert refused["status_code"] == 413
    error = refused["body"]["error"]
    assert error["code"] == "request_too_large"
    assert f"a batch line may have at most {bound}" in error["message"]


def test_a_line_far_past_the_context_is_refused_without_tokenizing_it_whole(make_batch_worker):
    """30 messages of 60,000 characters (1.8 MB, inside the line's 2 MiB): refused after a
    piece's tokenizing, which is what 'at least' tells; tokenizing it whole took seconds and
    hundreds of MB (tests/protocol/test_prompt_length.py measures both)."""
    worker = make_batch_worker()
    limit = worker.ctx.engine.engine.max_model_len
    messages = [{"role": "user", "content": "word " * 12_000} for _ in range(30)]
    batch_id = submit(worker, [chat_line("long", messages=messages), chat_line("ok")])
    assert batch(worker, batch_id).request_failed == 1
    run_all_shards(worker, batch_id)
    _, results = finalized(worker, batch_id)
    assert results["ok"]["response"]["status_code"] == 200
    error = results["long"]["response"]["body"]["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens" in error["message"]
    assert "you requested at least" in error["message"]


def request_body(worker, batch_id: str, custom_id: str) -> dict:
    with worker.ctx.session_factory() as session:
        return session.scalar(
            select(BatchRequest.body).where(
                BatchRequest.batch_id == batch_id, BatchRequest.custom_id == custom_id
            )
        )

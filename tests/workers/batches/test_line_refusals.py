"""Lines the endpoint would refuse (a prompt past the context, a bad parameter) are refused while
the batch is validated, when the validating worker has the engine: each fails alone with the 400
the endpoint answers, counted at once, before any engine work, and the batch goes on."""

from __future__ import annotations

from batch_worker import (
    batch,
    chat_line,
    finalized,
    pending_requests,
    run_all_shards,
    shard_states,
    submit,
)

from pagedbatch.store.models import BatchStatus


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

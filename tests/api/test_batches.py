"""The Batches API end to end through the official SDK, on the embedded service: validation,
results, cancellation, expiry, fairness, tenants and idempotency. Each test runs on both stores
(SQLite and a local directory; PostgreSQL and the S3 server)."""

from __future__ import annotations

import json
import time

import openai
import pytest
from servers import STORAGES, BatchServer, wait_for_batch

from pagedbatch.workers import leases

pytestmark = pytest.mark.parametrize("storage", STORAGES, indirect=True)

TERMINAL = {"completed", "failed", "cancelled", "expired"}


def chat_line(custom_id: str, content: str = "Hello", max_tokens: int = 8, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def upload(client: openai.OpenAI, lines: list[dict | str]) -> str:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    return client.files.create(file=("input.jsonl", text.encode()), purpose="batch").id


def create(client: openai.OpenAI, lines: list[dict | str], **kwargs) -> openai.types.Batch:
    return client.batches.create(
        input_file_id=upload(client, lines),
        endpoint=kwargs.pop("endpoint", "/v1/chat/completions"),
        completion_window="24h",
        **kwargs,
    )


def finished(client, batch_id, timeout=120.0):
    return wait_for_batch(client, batch_id, lambda b: b.status in TERMINAL, timeout)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def results(client: openai.OpenAI, batch: openai.types.Batch) -> tuple[list[dict], list[dict]]:
    """The lines of the batch's output file and of its error file."""
    return read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)


def assert_engine_idle(server: BatchServer, within: float = 5.0) -> None:
    """The engine holds no request and every KV block is free (aborts land within a step)."""
    engine = server.embedded.context.engine.engine
    deadline = time.monotonic() + within
    while True:
        stats = engine.get_stats()
        idle = stats["running"] == stats["waiting"] == 0
        if idle and stats["free_kv_blocks"] == stats["total_kv_blocks"]:
            return
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        time.sleep(0.05)


def test_every_line_lands_once_in_the_output_or_error_file(serve_batches):
    server = serve_batches()
    client = server.client()
    good = [chat_line(f"ok-{i}", f"Tell me about {i}") for i in range(10)]
    bad = [chat_line("too-hot", temperature=5), chat_line("too-long", max_tokens=10**6)]
    batch = create(
        client,
        good[:5] + bad + good[5:],
        metadata={"job": "nightly"},
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert batch.status == "validating" and batch.request_counts.total == 0
    assert batch.expires_at == batch.created_at + 24 * 3600

    batch = finished(client, batch.id)
    assert batch.status == "completed"
    assert batch.request_counts.model_dump() == {"total": 12, "completed": 10, "failed": 2}
    assert batch.metadata == {"job": "nightly"} and batch.model == "tiny"
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    output, errors = results(client, batch)
    assert sorted(line["custom_id"] for line in output) == sorted(f"ok-{i}" for i in range(10))
    assert {line["custom_id"]: line["response"]["status_code"] for line in errors} == {
        "too-hot": 400,
        "too-long": 400,
    }
    for line in output:
        body = line["response"]["body"]
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    assert batch.usage.output_tokens == sum(
        line["response"]["body"]["usage"]["completion_tokens"] for line in output
    )
    assert batch.usage.input_tokens == sum(
        line["response"]["body"]["usage"]["prompt_tokens"] for line in output
    )
    for file_id in (batch.output_file_id, batch.error_file_id):
        result_file = client.files.retrieve(file_id)
        assert result_file.purpose == "batch_output"
        assert result_file.expires_at == result_file.created_at + 7200
    assert_engine_idle(server)


def test_request_counts_move_while_the_batch_runs(serve_batches):
    client = serve_batches().client()
    lines = [chat_line(f"r{i}", max_tokens=32, ignore_eos=True) for i in range(24)]
    batch = create(client, lines)
    done_while_running: list[int] = []
    deadline = time.monotonic() + 120
    while batch.status not in TERMINAL:
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        if batch.status == "in_progress":
            assert batch.request_counts.total == 24
            done_while_running.append(batch.request_counts.completed + batch.request_counts.failed)
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed"
    assert done_while_running == sorted(done_while_running)
    midway = {done for done in done_while_running if 0 < done < 24}
    assert len(midway) >= 2, f"counts seen while in progress: {done_while_running}"


def test_batch_results_equal_the_engine_run_directly(serve_batches):
    server = serve_batches()
    client = server.client()
    batch = create(client, [chat_line("a", "One fine day", max_tokens=12, temperature=0)])
    batch = finished(client, batch.id)
    (line,) = read_lines(client, batch.output_file_id)
    from pagedbatch.engine import SamplingParams

    engine = server.embedded.context.engine.engine
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "One fine day"}], add_generation_prompt=True, tokenize=False
    )
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    from pagedbatch.engine import LLM

    expected = LLM(server.settings.model, num_kv_blocks=64).generate(
        [ids], SamplingParams(temperature=0, max_tokens=12)
    )[0]
    assert line["response"]["body"]["choices"][0]["message"]["content"] == expected.text


def test_completions_batches_run_too(serve_batches):
    client = serve_batches().client()
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": f"Once upon a time {i}", "max_tokens": 5},
        }
        for i in range(3)
    ]
    batch = finished(client, create(client, lines, endpoint="/v1/completions").id)
    output = read_lines(client, batch.output_file_id)
    assert batch.status == "completed" and len(output) == 3
    assert all(line["response"]["body"]["object"] == "text_completion" for line in output)


@pytest.mark.parametrize(
    "lines, code, line_number, param",
    [
        (["{not json", chat_line("b")], "invalid_json_line", 1, None),
        ([chat_line("a"), chat_line("a")], "duplicate_custom_id", 2, "custom_id"),
        ([chat_line("a"), {**chat_line("b"), "url": "/v1/completions"}], "invalid_url", 2, "url"),
        ([chat_line("a"), {**chat_line("b"), "method": "GET"}], "invalid_method", 2, "method"),
        (
            [chat_line("a"), {**chat_line("b"), "body": {"model": "other", "messages": []}}],
            "mismatched_model",
            2,
            "body.model",
        ),
        (
            [{**chat_line("a"), "body": {"model": "nope", "messages": []}}],
            "model_not_found",
            1,
            "body.model",
        ),
        (
            [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}],
            "missing_required_parameter",
            1,
            "body",
        ),
        ([chat_line("a", stream=True)], "stream_not_supported", 1, "body.stream"),
        ([chat_line("a\u0000b")], "invalid_value", 1, "custom_id"),
    ],
    ids=[
        "json",
        "duplicate",
        "url",
        "method",
        "mismatched-model",
        "unknown-model",
        "no-body",
        "stream",
        "nul",
    ],
)
def test_validation_failures_fail_the_batch_with_line_numbers(
    serve_batches, lines, code, line_number, param
):
    client = serve_batches().client()
    batch = finished(client, create(client, lines).id)
    assert batch.status == "failed" and batch.failed_at
    assert batch.output_file_id is None and batch.error_file_id is None
    (error,) = [e for e in batch.errors.data if e.code == code]
    assert error.line == line_number and error.param == param and error.message
    assert batch.request_counts.total == 0


def test_every_problem_of_a_file_is_reported(serve_batches):
    client = serve_batches().client()
    lines = [chat_line("a"), "[]", chat_line("a"), {**chat_line("c"), "method": "PUT"}]
    batch = finished(client, create(client, lines).id)
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("invalid_json_line", 2),
        ("duplicate_custom_id", 3),
        ("invalid_method", 4),
    ]


def test_limits_on_lines_and_empty_files(serve_batches):
    client = serve_batches(max_batch_lines=3).client()
    batch = finished(client, create(client, [chat_line(f"r{i}") for i in range(4)]).id)
    assert [e.code for e in batch.errors.data] == ["too_many_lines"]
    batch = finished(client, create(client, ["", "  "]).id)
    assert [e.code for e in batch.errors.data] == ["empty_file"]


def test_bad_create_requests_get_400s_and_create_nothing(serve_batches):
    client = serve_batches().client()
    file_id = upload(client, [chat_line("a")])
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
        )
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="1h"
        )
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    other = client.files.create(file=("notes.txt", b"hi"), purpose="user_data").id
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(
            input_file_id=other, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert e.value.body["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={f"k{i}": "v" for i in range(17)},
        )
    assert client.batches.list().data == []


def test_cancel_mid_run_keeps_partial_results_and_frees_the_engine(serve_batches):
    server = serve_batches(shard_size=2)
    client = server.client()
    lines = [chat_line(f"r{i}", max_tokens=200, ignore_eos=True) for i in range(40)]
    batch = create(client, lines)
    wait_for_batch(client, batch.id, lambda b: b.request_counts.completed >= 2, timeout=120.0)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = finished(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    output, errors = results(client, batch)
    assert 2 <= len(output) < 40
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert sorted(line["custom_id"] for line in output + errors) == sorted(
        f"r{i}" for i in range(40)
    )
    assert batch.request_counts.completed == len(output)
    assert batch.request_counts.failed == len(errors)
    assert_engine_idle(server)


def test_a_shard_that_ends_before_it_sees_the_cancel_still_finalizes(serve_batches, monkeypatch):
    # The shard's watcher does not look again before its lines are done.
    monkeypatch.setattr(leases, "STOP_CHECK_SECONDS", 60.0)
    server = serve_batches(shard_size=2, worker_concurrency=1, lease_seconds=300.0)
    client = server.client()
    # Ten shards, so that most are still to run when the cancel comes, however fast the CPU.
    lines = [chat_line(f"r{i}", max_tokens=150, ignore_eos=True) for i in range(20)]
    batch = create(client, lines)
    wait_for_batch(client, batch.id, lambda b: b.request_counts.completed >= 2, timeout=120.0)
    client.batches.cancel(batch.id)  # its finalization finds a shard running, and leaves it
    batch = finished(client, batch.id, timeout=60)
    assert batch.status == "cancelled"
    output, errors = results(client, batch)
    assert len(output) + len(errors) == 20 and len(errors) >= 2
    assert_engine_idle(server)


def test_cancelling_a_finished_batch_is_a_400(serve_batches):
    client = serve_batches().client()
    batch = finished(client, create(client, [chat_line("a")]).id)
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.cancel(batch.id)
    assert e.value.body["code"] == "batch_not_cancellable"


def test_past_its_window_a_batch_expires_with_batch_expired_lines(serve_batches):
    server = serve_batches(completion_window_seconds=3, shard_size=2)
    client = server.client()
    # 45,000 tokens, well past what a CPU runs the tiny model through in the window.
    lines = [chat_line(f"r{i}", max_tokens=1500, ignore_eos=True) for i in range(30)]
    batch = finished(client, create(client, lines).id)
    assert batch.status == "expired" and batch.expired_at
    output, errors = results(client, batch)
    expired = [line for line in errors if line["error"]["code"] == "batch_expired"]
    assert expired and len(output) + len(errors) == 30
    assert_engine_idle(server)


def test_a_small_batch_is_not_stuck_behind_another_tenants_large_one(serve_batches):
    server = serve_batches(api_keys=["alice", "bob"], shard_size=2)
    alice, bob = server.client("alice"), server.client("bob")
    large = create(alice, [chat_line(f"a{i}", max_tokens=64, ignore_eos=True) for i in range(40)])
    wait_for_batch(alice, large.id, lambda b: b.status == "in_progress", timeout=120.0)
    small = create(bob, [chat_line(f"b{i}", max_tokens=8) for i in range(2)])
    small = finished(bob, small.id)
    large_now = alice.batches.retrieve(large.id)
    assert small.status == "completed"
    assert large_now.status == "in_progress"
    assert large_now.request_counts.completed < 30
    finished(alice, large.id)


def test_tenants_cannot_see_each_others_batches(serve_batches):
    server = serve_batches(api_keys=["k1", "k2"])
    mine, theirs = server.client("k1"), server.client("k2")
    batch = finished(mine, create(mine, [chat_line("a")]).id)
    with pytest.raises(openai.NotFoundError):
        theirs.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        theirs.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        theirs.files.content(batch.output_file_id)
    with pytest.raises(openai.NotFoundError):  # nor start a batch on another tenant's file
        theirs.batches.create(
            input_file_id=batch.input_file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    assert theirs.batches.list().data == []
    assert [b.id for b in mine.batches.list()] == [batch.id]
    with pytest.raises(openai.AuthenticationError):
        server.client("nobody").batches.list()


def test_idempotency_key_returns_the_first_batch(serve_batches):
    client = serve_batches().client()
    file_id = upload(client, [chat_line("a")])
    headers = {"Idempotency-Key": "nightly-2026-12-02"}
    first = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_headers=headers,
    )
    again = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_headers=headers,
    )
    assert again.id == first.id
    assert [b.id for b in client.batches.list()] == [first.id]


def test_list_pages_newest_first(serve_batches):
    client = serve_batches().client()
    file_id = upload(client, [chat_line("a")])
    ids = [
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(5)
    ]
    page = client.batches.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    assert [b.id for b in client.batches.list(limit=2)] == list(reversed(ids))

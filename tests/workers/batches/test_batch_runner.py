"""The batch runner: batch input lines through a real engine on a tiny checkpoint."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from vision_oracle import chat_text, data_url, image

from pagedbatch.engine import AsyncLLM, SamplingParams
from pagedbatch.engine.multimodal.inputs import place
from pagedbatch.protocol.batch_lines import BatchOutputLine
from pagedbatch.protocol.pipeline import RequestContext
from pagedbatch.protocol.safety import SafetyPolicy
from pagedbatch.protocol.serving.common import BATCH_PRIORITY
from pagedbatch.workers.batches.runner import BatchProgress, BatchRunner

GREEDY_6 = SamplingParams(temperature=0, max_tokens=6)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# Lines as the default tenant's with the content filter off, unless a test screens them.
UNSCREENED = RequestContext(
    door="batch",
    priority=BATCH_PRIORITY,
    request_id=None,
    cache_salt=None,
    policy=SafetyPolicy(),
    guard=None,
    output_check_tokens=8,
)


@pytest.fixture(scope="module")
def engine(tiny_llama) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(tiny_llama, max_num_seqs=4, num_kv_blocks=256)
    yield llm
    llm.shutdown()


def line(engine: AsyncLLM, custom_id: str, url: str = CHAT, **body: Any) -> str:
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": f"Question {custom_id}?"}])
    else:
        body.setdefault("prompt", f"Story {custom_id}:")
    body = {"model": engine.engine.model_name, "max_tokens": 4, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def run(
    engine: AsyncLLM,
    lines: list[str],
    max_in_flight: int = 8,
    context: RequestContext = UNSCREENED,
) -> tuple[list[BatchOutputLine], list[BatchProgress]]:
    written: list[BatchOutputLine] = []
    progress: list[BatchProgress] = []

    def on_progress(p: BatchProgress) -> None:
        progress.append(BatchProgress(p.lines_done, p.lines_failed, p.generated_tokens))

    runner = BatchRunner(engine, context, max_in_flight=max_in_flight)
    final = runner.run(lines, written.append, on_progress)
    assert progress[-1] == final
    return written, progress


def by_custom_id(written: list[BatchOutputLine]) -> dict[str | None, BatchOutputLine]:
    results = {w.custom_id: w for w in written}
    assert len(results) == len(written)
    return results


def direct(
    engine: AsyncLLM, prompt_ids: list[int], params: SamplingParams, media: tuple = ()
) -> str:
    async def final() -> str:
        async for output in engine.generate(prompt_ids, params, final_only=True, media=media):
            return output.outputs[0].text
        raise AssertionError("no output")

    return asyncio.run(final())


def test_every_line_gets_one_output_line(engine):
    lines = [line(engine, f"c{i}") for i in range(6)] + [
        line(engine, f"p{i}", COMPLETIONS) for i in range(3)
    ]
    written, progress = run(engine, lines, max_in_flight=4)
    results = by_custom_id(written)
    assert set(results) == {json.loads(raw)["custom_id"] for raw in lines}
    for custom_id, result in results.items():
        assert result.id.startswith("batch_req_")
        assert result.error is None
        assert result.response.status_code == 200
        assert result.response.request_id.startswith("req_")
        expected = "chat.completion" if custom_id.startswith("c") else "text_completion"
        assert result.response.body["object"] == expected
    generated = sum(r.response.body["usage"]["completion_tokens"] for r in results.values())
    assert progress[-1] == BatchProgress(lines_done=9, lines_failed=0, generated_tokens=generated)
    assert [p.lines_done for p in progress] == sorted(p.lines_done for p in progress)


def test_usage_matches_the_tokenizer(engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    results = by_custom_id(run(engine, [line(engine, "a", messages=messages, max_tokens=3)])[0])
    usage = results["a"].response.body["usage"]
    template = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_tokens = len(engine.tokenizer.encode(template, add_special_tokens=False))
    assert usage["prompt_tokens"] == prompt_tokens
    assert 1 <= usage["completion_tokens"] <= 3
    assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]


def test_greedy_text_is_what_the_engine_gives_for_the_same_prompt(engine):
    messages = [{"role": "user", "content": "Name a colour."}]
    lines = [
        line(engine, "chat", messages=messages, temperature=0, max_tokens=8),
        line(engine, "cmpl", COMPLETIONS, prompt="hello world", temperature=0, max_tokens=8),
    ]
    results = by_custom_id(run(engine, lines)[0])
    greedy = SamplingParams(temperature=0, max_tokens=8)
    template = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    chat_ids = engine.tokenizer.encode(template, add_special_tokens=False)
    assert results["chat"].response.body["choices"][0]["message"]["content"] == direct(
        engine, chat_ids, greedy
    )
    assert results["cmpl"].response.body["choices"][0]["text"] == direct(
        engine, engine.tokenizer.encode("hello world"), greedy
    )


def test_bad_lines_become_error_lines_and_bad_bodies_error_responses(engine):
    lines = [
        line(engine, "ok"),
        "{this is not json",
        "",
        line(engine, "hot", temperature=5),
        line(engine, "who", model="gpt-4o"),
        line(engine, "long", max_tokens=engine.engine.max_model_len),
        line(engine, "vocab", COMPLETIONS, prompt=[10**9]),
        line(engine, "streamed", stream=True),
        line(engine, "ok"),
        json.dumps({"custom_id": "get", "method": "GET", "url": CHAT, "body": {}}),
    ]
    written, progress = run(engine, lines)
    # The first "ok" runs; the second repeats its custom_id and gets an error line.
    oks = [
        w.error.code if w.error else w.response.status_code for w in written if w.custom_id == "ok"
    ]
    assert sorted(oks, key=str) == [200, "duplicate_custom_id"]
    results = by_custom_id([w for w in written if w.custom_id != "ok"])

    def error_response(custom_id: str) -> tuple[int, dict[str, Any]]:
        result = results[custom_id]
        assert result.error is None
        return result.response.status_code, result.response.body["error"]

    status, error = error_response("hot")
    assert (status, error["param"], error["type"]) == (400, "temperature", "invalid_request_error")
    status, error = error_response("who")
    assert (status, error["code"]) == (404, "model_not_found")
    status, error = error_response("long")
    assert (status, error["code"]) == (400, "context_length_exceeded")
    status, error = error_response("vocab")
    assert status == 400
    assert set(error) == {"message", "type", "param", "code"}

    def error_line(custom_id: str | None) -> tuple[str, int | None]:
        result = results[custom_id]
        assert result.response is None
        return result.error.code, result.error.line

    assert error_line(None) == ("invalid_json_line", 2)
    assert error_line("streamed") == ("stream_not_supported", 8)
    assert error_line("get") == ("invalid_method", 10)
    assert (progress[-1].lines_done, progress[-1].lines_failed) == (9, 8)


def test_a_line_with_several_prompts_gets_one_response(engine):
    written, _ = run(engine, [line(engine, "multi", COMPLETIONS, prompt=["one", "two"], n=2)])
    results = by_custom_id(written)
    choices = results["multi"].response.body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]


def test_lines_are_read_as_room_frees_up(engine):
    max_in_flight, reads, in_flight_at_write = 3, [0], []

    def lines() -> Iterator[str]:
        for i in range(12):
            reads[0] += 1
            yield line(engine, f"r{i}", max_tokens=2 + i % 3)

    def write(result: BatchOutputLine) -> None:
        in_flight_at_write.append(reads[0] - len(in_flight_at_write))

    BatchRunner(engine, UNSCREENED, max_in_flight=max_in_flight).run(lines(), write)
    assert len(in_flight_at_write) == 12
    assert max(in_flight_at_write) <= max_in_flight
    assert in_flight_at_write[0] < 12  # the first result came before the whole input was read


def test_lines_with_images_are_prepared_off_the_engine_thread(make_checkpoint):
    """Each line's images are decoded on a preparing thread; the answers are the engine's own
    for those images, in whatever order lines finish."""
    llava = AsyncLLM(make_checkpoint("llava"), max_num_seqs=4)
    threads: set[str] = set()
    processor = llava.engine.image_processor
    original = type(processor).__call__

    def traced(self, image):
        threads.add(threading.current_thread().name)
        return original(self, image)

    pictures = [image(40 + i, 50 + 10 * i, 70) for i in range(6)]
    lines = [
        line(
            llava,
            f"img-{i}",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(p)}},
                        {"type": "text", "text": "What is it?"},
                    ],
                }
            ],
            temperature=0,
            max_tokens=6,
        )
        for i, p in enumerate(pictures)
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(processor), "__call__", traced)
        written, _ = run(llava, lines, max_in_flight=3)
    assert threads and not threads & {threading.main_thread().name}
    results = by_custom_id(written)
    for i, picture in enumerate(pictures):
        body = results[f"img-{i}"].response.body
        assert body["usage"]["prompt_tokens_details"]["image_tokens"] == 16
        text = chat_text(make_checkpoint("llava"), "What is it?", 1)
        prompt_ids, items = place(llava.tokenizer.encode(text), [processor(picture)])
        expected = direct(llava, prompt_ids, GREEDY_6, tuple(items))
        assert body["choices"][0]["message"]["content"] == expected
    llava.shutdown()


def test_lines_pass_the_content_filter_as_the_services_do(engine):
    """The service's pipeline: a prompt the blocklist matches is a 400 content_filter before the
    engine sees it; an output it matches stops with finish_reason content_filter."""
    story = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 16}
    unfiltered = run(engine, [line(engine, "free", COMPLETIONS, **story)])
    text = unfiltered[0][0].response.body["choices"][0]["text"]
    banned = text.split()[len(text.split()) // 2]
    policy = SafetyPolicy(checks="both", blocklist=(re.compile(re.escape(banned)),))
    screened = replace(UNSCREENED, policy=policy)
    lines = [
        line(engine, "out", COMPLETIONS, **story),
        line(engine, "in", COMPLETIONS, prompt=f"Say {banned}"),
    ]
    results = by_custom_id(run(engine, lines, context=screened)[0])
    choice = results["out"].response.body["choices"][0]
    assert choice["finish_reason"] == "content_filter" and banned not in choice["text"]
    refused = results["in"].response
    assert (refused.status_code, refused.body["error"]["code"]) == (400, "content_filter")

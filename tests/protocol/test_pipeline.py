"""One request's pipeline, as every door runs it: the moderation engine's requests are never
screened and are free; an engine's refusal is an OpenAI 400; usage is counted from the engine's
outputs; a flagged output stops the request, in pieces as it comes or once whole."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

import pytest

from pagedbatch.engine import AsyncLLM, SamplingParams
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.pipeline import RequestContext, RequestPipeline
from pagedbatch.protocol.safety import SafetyPolicy
from pagedbatch.protocol.schemas.completions import CompletionRequest
from pagedbatch.protocol.schemas.moderations import ModerationRequest
from pagedbatch.protocol.serving.common import BATCH_PRIORITY, check_context_length
from pagedbatch.protocol.serving.completions import prepare_completion
from pagedbatch.protocol.serving.moderations import prepare_moderation

PROMPT = "The quick brown fox"
MAX_TOKENS = 24


def context(checks: str = "off", blocklist: tuple[str, ...] = (), **changes) -> RequestContext:
    policy = SafetyPolicy(checks=checks, blocklist=tuple(re.compile(p) for p in blocklist))
    made = RequestContext(
        door="batch",
        priority=BATCH_PRIORITY,
        request_id="line-1",
        cache_salt=None,
        policy=policy,
        guard=None,  # the blocklist alone screens
        output_check_tokens=4,
    )
    return replace(made, **changes)


def completion(llm: AsyncLLM, **fields):
    body = {"model": llm.engine.model_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    body |= {"temperature": 0, "ignore_eos": True, **fields}
    return prepare_completion(CompletionRequest.model_validate(body), llm.engine)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = AsyncLLM(tiny_llama, num_kv_blocks=128)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def classifier(make_checkpoint):
    engine = AsyncLLM(make_checkpoint("llama", task="classify"), num_kv_blocks=128)
    yield engine
    engine.shutdown()


def whole(llm: AsyncLLM, prepared, ctx: RequestContext, **options):
    async def main():
        pipeline = RequestPipeline(llm, prepared, ctx)
        await pipeline.screen_input()
        outputs = await pipeline.final_outputs(**options)
        return outputs, pipeline.usage(outputs)

    return asyncio.run(main())


def test_the_moderation_engines_requests_are_neither_screened_nor_charged(classifier):
    def prepared():
        request = ModerationRequest(input=["forbidden words", "a quiet evening"])
        return prepare_moderation(request, classifier.engine, 0.5, 8)

    # A blocklist that matches any text, the empty one too: whatever is screened is stopped.
    ctx = context("both", ("^",))
    outputs, used = whole(classifier, prepared(), replace(ctx, moderation=True))
    assert used is None
    assert {o.outputs[0].finish_reason for o in outputs} != {"content_filter"}
    assert len(prepared().response(outputs).results) == 2
    # The same requests as a language model's: their outputs would be stopped.
    outputs, used = whole(classifier, prepared(), ctx)
    assert {o.outputs[0].finish_reason for o in outputs} == {"content_filter"}
    assert used is not None


def test_an_engine_refusal_is_a_400(llm):
    prepared = completion(llm)
    # Past what the serving layer checks: the engine's own limit refuses it.
    params = replace(prepared.inputs[0].params, max_tokens=llm.engine.max_model_len * 2)
    prepared.inputs[0] = replace(prepared.inputs[0], params=params)
    with pytest.raises(OpenAIError) as caught:
        whole(llm, prepared, context())
    assert caught.value.status_code == 400
    assert "maximum context length" in caught.value.detail.message


def test_usage_is_counted_from_the_engine_outputs(llm):
    prepared = completion(llm, n=2, prompt=[PROMPT, "Hello there"])
    prompts = [len(i.prompt_token_ids) for i in prepared.inputs]
    outputs, used = whole(llm, prepared, context())
    assert used.prompt_tokens == sum(prompts)
    assert used.completion_tokens == 2 * 2 * MAX_TOKENS
    assert used.total_tokens == sum(prompts) + 4 * MAX_TOKENS
    assert prepared.response(outputs).usage == used


@pytest.mark.parametrize("at_end", [False, True], ids=["in pieces", "once whole"])
def test_a_flagged_output_stops_the_request(llm, at_end):
    unfiltered = whole(llm, completion(llm), context())[0][0].outputs[0].text
    words = unfiltered.split()
    assert len(words) > 4, unfiltered
    banned = words[len(words) // 2]
    # Input screening passes (the prompt holds no banned word); the output is stopped.
    ctx = context("both", (re.escape(banned),))
    outputs, used = whole(llm, completion(llm), ctx, screen_at_end=at_end)
    choice = outputs[0].outputs[0]
    assert choice.finish_reason == "content_filter"
    assert banned not in choice.text and unfiltered.startswith(choice.text)
    if not at_end:  # stopped mid-way: the engine generated less than all of it
        assert used.completion_tokens < MAX_TOKENS
    with pytest.raises(OpenAIError) as caught:
        whole(llm, completion(llm, prompt=f"{PROMPT} {banned}"), ctx)
    assert caught.value.detail.code == "content_filter"


def test_the_engine_and_the_api_agree_on_what_fits_the_context(llm):
    served = llm.engine
    limit = served.max_model_len
    for prompt_len in (limit - 8, limit - 1, limit):
        room = limit - prompt_len
        for max_tokens in (None, *(m for m in (room - 1, room, room + 1) if m >= 1)):
            api_refuses = engine_refuses = False
            try:
                check_context_length(prompt_len, max_tokens, served, param="prompt")
            except OpenAIError as exc:
                assert exc.detail.code == "context_length_exceeded"
                api_refuses = True
            try:
                params = SamplingParams(max_tokens=max_tokens)
                served.inputs.process("fit", [5] * prompt_len, params, 0, None, None)
            except ValueError:
                engine_refuses = True
            assert api_refuses == engine_refuses, (prompt_len, max_tokens)

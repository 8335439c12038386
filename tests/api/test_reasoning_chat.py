"""A reasoning model's chat answers through the official SDK, realtime, streamed and in a batch:
its thinking apart as `reasoning_content`, counted in `reasoning_tokens`; `reasoning_effort`
"none" turns the template's thinking switch off. The checkpoint is tiny's with `<think>` and
`</think>` added to its vocabulary, and a chat template of each kind: DeepSeek-R1's (the prompt
opens the thinking) and Qwen3's (the model opens it; a switch writes an empty one instead)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from test_batches import create, finished, read_lines
from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer

from pagedbatch.demo_tokenizer import CHAT_TEMPLATE, VOCAB_SIZE
from pagedbatch.engine import LLMEngine
from pagedbatch.engine.config import EngineArgs
from pagedbatch.protocol.reasoning import ReasoningSplitter

embedded = pytest.mark.parametrize("storage", ["embedded"], indirect=True)

THINK, END_THINK = VOCAB_SIZE, VOCAB_SIZE + 1  # the ids the two tags take
GENERATION_PROMPT = '{{- "<|im_start|>assistant\\n" -}}'
TEMPLATES = {
    "r1": CHAT_TEMPLATE.replace(GENERATION_PROMPT, '{{- "<|im_start|>assistant\\n<think>\\n" -}}'),
    "qwen3": CHAT_TEMPLATE.replace(
        GENERATION_PROMPT,
        GENERATION_PROMPT + "{%- if enable_thinking is defined and not enable_thinking -%}"
        '{{- "<think>\\n\\n</think>\\n\\n" -}}{%- endif -%}',
    ),
}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinker(make_checkpoint, tmp_path_factory) -> Callable[[str], Path]:
    """`thinker(kind)`: the reasoning checkpoint with the chat template of `kind`."""
    base = make_checkpoint("llama", vocab_size=VOCAB_SIZE + 2)

    def make(kind: str) -> Path:
        out = tmp_path_factory.mktemp(f"thinker-{kind}")
        shutil.copytree(base, out, dirs_exist_ok=True)
        tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
        tokenizer.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
        tokenizer.save(str(out / "tokenizer.json"))
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = TEMPLATES[kind]
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        return out

    return make


def ask(client, **fields: Any):
    body = {"model": "thinker", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    return client.chat.completions.create(**{**body, **fields})


def streamed(client, **fields: Any) -> tuple[str, str, int]:
    """The joined reasoning and content deltas of a streamed answer, and its reasoning tokens."""
    reasoning, content, usage = [], [], None
    options = {"include_usage": True}
    for chunk in ask(client, stream=True, stream_options=options, **fields):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning.append(choice.delta.model_extra.get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    return "".join(reasoning), "".join(content), usage.completion_tokens_details.reasoning_tokens


@embedded
def test_an_answer_after_the_thinking_is_content_and_the_rest_reasoning(serve_batches, thinker):
    client = serve_batches(model=str(thinker("r1")), served_model_name="thinker").client()
    # Every token the closing tag: the thinking ends at once, the rest is content.
    bias = {str(END_THINK): 100}
    answer = ask(client, logit_bias=bias)
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == ""
    assert message.content == "</think>" * 5
    assert answer.usage.completion_tokens_details.reasoning_tokens == 1
    # Never closed (cut by max_tokens): all of it is thinking.
    (choice,) = ask(client, logit_bias={str(END_THINK): -100}).choices
    raw = client.completions.create(
        model="thinker",
        prompt=rendered(thinker("r1")),
        max_tokens=6,
        temperature=0,
        logit_bias={str(END_THINK): -100},
    )
    assert choice.message.model_extra["reasoning_content"] == raw.choices[0].text
    assert choice.message.content is None
    assert streamed(client, logit_bias=bias) == ("", "</think>" * 5, 1)


def rendered(model: Path) -> str:
    """The chat prompt as text, for /v1/completions to continue."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    return tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


@embedded
def test_a_model_that_opens_its_thinking_and_its_switch(serve_batches, thinker):
    client = serve_batches(model=str(thinker("qwen3")), served_model_name="thinker").client()
    opens = {str(THINK): 100}
    answer = ask(client, logit_bias=opens)
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == "<think>" * 5
    assert message.content is None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 6
    assert streamed(client, logit_bias=opens) == ("<think>" * 5, "", 6)
    # Never opened: content only.
    plain = ask(client, logit_bias={str(THINK): -100})
    assert "reasoning_content" not in plain.choices[0].message.model_extra
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    # reasoning_effort none: the template's switch writes an empty thinking into the prompt.
    off = ask(client, reasoning_effort="none", logit_bias={str(THINK): -100})
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens + 6  # <think>\n\n</think>\n\n


@embedded
def test_a_batch_line_answers_as_the_realtime_door(serve_batches, thinker):
    client = serve_batches(model=str(thinker("r1")), served_model_name="thinker").client()
    body = {
        "model": "thinker",
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "logit_bias": {str(END_THINK): 100},
    }
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}
    (out,) = read_lines(client, finished(client, create(client, [line]).id).output_file_id)
    answer = out["response"]["body"]
    assert answer["choices"][0]["message"]["reasoning_content"] == ""
    assert answer["choices"][0]["message"]["content"] == "</think>" * 5
    assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1


CITY = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Lyon"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@embedded
def test_a_response_format_applies_after_the_thinking(serve_batches, thinker):
    """As vLLM: the thinking is free (the grammar waits for `</think>`), then the answer obeys
    the schema. The prompt opens the thinking (R1's template); a bias on `</think>` makes the
    tiny model close it a few tokens in."""
    client = serve_batches(model=str(thinker("r1")), served_model_name="thinker").client()
    for strength in range(1, 40):  # the least bias that closes the thinking past 2 tokens
        bias = {str(END_THINK): strength}
        free = ask(client, logit_bias=bias, max_tokens=12).choices[0].message
        thought = free.model_extra["reasoning_content"]
        if free.content is not None and len(thought) > 2:
            break
    else:
        pytest.fail("no bias closed the thinking")
    answer = ask(client, logit_bias=bias, max_tokens=40, response_format=CITY)
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == thought  # free, as without the schema
    assert json.loads(message.content)["city"] in ("Paris", "Lyon")
    assert answer.choices[0].finish_reason == "stop"  # the grammar ended it
    reasoning, content, thinking = streamed(
        client, logit_bias=bias, max_tokens=40, response_format=CITY
    )
    assert (reasoning, content) == (thought, message.content)
    assert thinking == answer.usage.completion_tokens_details.reasoning_tokens


@embedded
def test_a_prompt_that_closed_the_thinking_starts_the_grammar_at_once(serve_batches, thinker):
    """With thinking switched off, Qwen3's template writes an empty one into the prompt: the
    answer obeys from its first token, and cannot open a thinking of its own."""
    client = serve_batches(model=str(thinker("qwen3")), served_model_name="thinker").client()
    opens = {"logit_bias": {str(THINK): 100}, "reasoning_effort": "none", "max_tokens": 40}
    free = ask(client, **opens).choices[0].message
    assert free.model_extra["reasoning_content"]  # free, it would think
    answer = ask(client, **opens, response_format=CITY).choices[0].message
    assert "reasoning_content" not in answer.model_extra
    assert json.loads(answer.content)["city"] in ("Paris", "Lyon")
    # Thinking switched on, the grammar waits for `</think>`: never closed here, all thinking.
    thinking = ask(client, logit_bias={str(THINK): 100}, max_tokens=6, response_format=CITY)
    assert thinking.choices[0].message.model_extra["reasoning_content"] == "<think>" * 5


def test_a_model_without_the_tags_is_not_split_and_a_named_parser_insists(tiny_llama, thinker):
    assert LLMEngine(EngineArgs(model=str(tiny_llama))).reasoning_tags is None
    with pytest.raises(ValueError, match="no <think> and </think> tokens"):
        LLMEngine(EngineArgs(model=str(tiny_llama), reasoning_parser="deepseek_r1"))
    none = LLMEngine(EngineArgs(model=str(thinker("r1")), reasoning_parser="none"))
    assert none.reasoning_tags is None
    assert ReasoningSplitter.for_prompt(None, "", none.tokenizer) is None


@embedded
def test_a_response_holds_the_thinking_as_a_reasoning_item_before_its_message(
    serve_batches, thinker
):
    client = serve_batches(model=str(thinker("r1")), served_model_name="thinker").client()
    # As chat answers the same greedy request: a reasoning item, then the message.
    body = {"model": "thinker", "input": MESSAGES[0]["content"], "max_output_tokens": 16}
    response = client.responses.create(**body, temperature=0, reasoning={"effort": "high"})
    chat = ask(client, max_tokens=16).choices[0].message
    thought = chat.model_extra["reasoning_content"]
    assert thought  # the tiny model thinks on to the end here
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content[0].text == thought
    assert message.type == "message" and response.output_text == (chat.content or "")
    thinking = response.usage.output_tokens_details.reasoning_tokens
    assert thinking == ask(client, max_tokens=16).usage.completion_tokens_details.reasoning_tokens
    # Streamed: the events tell the same items, the thinking's deltas joined.
    events = list(client.responses.create(**body, temperature=0, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    final = events[-1].response
    assert "".join(deltas) == final.output[0].content[0].text == reasoning.content[0].text
    assert [item.type for item in final.output] == ["reasoning", "message"]
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1]
    assert final.usage.output_tokens_details.reasoning_tokens == thinking
    # The thinking stays in the stored conversation's items and out of the next prompt.
    next_turn = {"model": "thinker", "max_output_tokens": 16}
    again = client.responses.create(
        **next_turn, input="And of Spain?", previous_response_id=response.id
    )
    bare = client.responses.create(
        input=[
            {"role": "user", "content": MESSAGES[0]["content"]},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "And of Spain?"},
        ],
        **next_turn,
    )
    assert again.usage.input_tokens == bare.usage.input_tokens


@embedded
def test_a_reasoning_effort_for_a_model_that_does_not_think_is_a_400(serve_batches):
    client = serve_batches().client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="Hi", reasoning={"effort": "high"})
    assert caught.value.body["param"] == "reasoning.effort"

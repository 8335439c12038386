"""Scoring through the official SDK at both doors, on the embedded service: vLLM's
prompt_logprobs (`extra_body`) in vLLM's response shape and completions' `echo` with `logprobs`
in OpenAI's, both equal to transformers' float32 log-softmax over the prompt; `best_of`; what is
out of bounds is an OpenAI-shaped 400. And beam search (vLLM's `use_beam_search`), equal
to transformers' `num_beams` generate."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import openai
import pytest
import torch
from test_batches import create, finished, read_lines
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.parametrize("storage", ["embedded"], indirect=True)

TOLERANCE = 1e-4
K = 3
MESSAGES = [{"role": "user", "content": "Score every token of this prompt"}]


@cache
def _oracle(model_dir: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def expected_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """Row i: the log-softmax that scores prompt token i + 1."""
    logits = _oracle(model_dir)(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def chat_prompt(model_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    return encoded["input_ids"]


def assert_vllm_shape(model_dir: Path, prompt: list[int], scored: list) -> None:
    """`scored` is vLLM's prompt_logprobs for `prompt`: None, then per position a dict (ids as
    JSON keys) holding the prompt's token and the top K, each {logprob, rank, decoded_token}."""
    assert scored[0] is None and len(scored) == len(prompt)
    rows = expected_logprobs(model_dir, prompt)
    for row, position, token in zip(rows, scored[1:], prompt[1:], strict=True):
        entry = position[str(token)]
        assert abs(entry["logprob"] - row[token].item()) < TOLERANCE
        top = torch.topk(row, K)
        ranked = {int(t): e for t, e in position.items() if e["rank"] <= K}
        assert sorted(ranked) == sorted(top.indices.tolist())
        for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(ranked[token_id]["logprob"] - value) < TOLERANCE
            assert isinstance(ranked[token_id]["decoded_token"], str)
        assert len(position) in (K, K + 1)


def test_prompt_logprobs_at_the_realtime_door(serve_batches, tiny_llama):
    client = serve_batches().client()
    prompt = [1, 450, 4996, 1354, 1701, 432, 1204, 975, 278, 13366, 11203]
    extra = {"prompt_logprobs": K}
    completion = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, n=2, extra_body=extra
    )
    for choice in completion.choices:
        assert_vllm_shape(tiny_llama, prompt, choice.model_extra["prompt_logprobs"])
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, extra_body=extra
    )
    assert_vllm_shape(tiny_llama, chat_prompt(tiny_llama), chat.model_extra["prompt_logprobs"])
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert "prompt_logprobs" not in plain.model_extra  # OpenAI's object, where not asked


def test_prompt_logprobs_in_batch_lines(serve_batches, tiny_llama):
    client = serve_batches().client()
    prompt = [1, 3251, 338, 263, 1243, 310, 278, 9853, 3402]
    body = {"model": "tiny", "max_tokens": 2, "prompt_logprobs": K}
    lines = [
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**body, "messages": MESSAGES},
        },
        {
            "custom_id": "completion",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**body, "prompt": prompt},
        },
    ]
    chat_batch = finished(client, create(client, lines[:1]).id)
    completion_batch = finished(client, create(client, lines[1:], endpoint="/v1/completions").id)
    (chat,) = read_lines(client, chat_batch.output_file_id)
    (completion,) = read_lines(client, completion_batch.output_file_id)
    assert_vllm_shape(
        tiny_llama, chat_prompt(tiny_llama), chat["response"]["body"]["prompt_logprobs"]
    )
    choice = completion["response"]["body"]["choices"][0]
    assert_vllm_shape(tiny_llama, prompt, choice["prompt_logprobs"])


@pytest.mark.parametrize(
    "body",
    [
        {"prompt_logprobs": 21},
        {"prompt_logprobs": -1},
        {"prompt_logprobs": 2, "stream": True},
    ],
)
def test_prompt_logprobs_out_of_bounds_are_400s(serve_batches, body):
    client = serve_batches().client()
    for create_call, args in (
        (client.chat.completions.create, {"messages": MESSAGES}),
        (client.completions.create, {"prompt": "Hello"}),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            create_call(model="tiny", max_tokens=2, extra_body=body, **args)
        error = caught.value.body
        assert error["param"] == "prompt_logprobs" and error["type"] == "invalid_request_error"


def test_echo_with_logprobs_scores_the_prompt_first(serve_batches, tiny_llama):
    client = serve_batches().client()
    prompt = [1, 3251, 338, 263, 1243, 310, 278, 9853, 3402]
    args = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2}
    (echoed,) = client.completions.create(**args, echo=True).choices
    (plain,) = client.completions.create(**args).choices
    logprobs = echoed.logprobs
    assert len(logprobs.tokens) == len(prompt) + 3 == len(logprobs.text_offset)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = expected_logprobs(tiny_llama, prompt)
    for i, token in enumerate(prompt[1:], start=1):
        assert abs(logprobs.token_logprobs[i] - expected[i - 1, token].item()) < TOLERANCE
        assert len(logprobs.top_logprobs[i]) <= 2
    # Then the completion's own, as without echo, its offsets after the prompt's text.
    assert logprobs.tokens[len(prompt) :] == plain.logprobs.tokens
    assert logprobs.token_logprobs[len(prompt) :] == pytest.approx(
        plain.logprobs.token_logprobs, abs=TOLERANCE
    )
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert echoed.text.endswith(plain.text)
    assert logprobs.text_offset[len(prompt)] == len(echoed.text) - len(plain.text)


def test_echo_with_logprobs_streams_the_prompt_first(serve_batches):
    """As vLLM streams it: each choice's first chunk holds its prompt, then its first tokens,
    and its logprobs the prompt's (null for the first token) before theirs; the chunks join
    into the whole response."""
    client = serve_batches().client()
    prompts = [[1, 3251, 338, 263, 1243, 310, 278, 9853, 3402], [1, 450, 4996, 1354]]
    args = {"model": "tiny", "prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2}
    args.update(logprobs=2, echo=True)
    whole = client.completions.create(**args).choices
    chunks = list(client.completions.create(**args, stream=True))
    assert all(len(chunk.choices) == 1 for chunk in chunks)
    for choice in whole:
        own = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        prompt = prompts[choice.index // 2]
        first = own[0].logprobs
        assert len(first.tokens) > len(prompt) and first.token_logprobs[0] is None
        assert first.top_logprobs[0] is None and first.text_offset[0] == 0
        echoed = choice.text[: first.text_offset[len(prompt)]]  # where the completion starts
        assert echoed and own[0].text.startswith(echoed)
        assert "".join(c.text for c in own) == choice.text
        for name in ("tokens", "text_offset"):
            assert [x for c in own for x in getattr(c.logprobs, name)] == getattr(
                choice.logprobs, name
            ), name
        streamed = [x for c in own for x in c.logprobs.token_logprobs]
        assert streamed == pytest.approx(choice.logprobs.token_logprobs, abs=TOLERANCE)
        tops = [x for c in own for x in c.logprobs.top_logprobs]
        assert [t and sorted(t) for t in tops] == [
            t and sorted(t) for t in choice.logprobs.top_logprobs
        ]
        assert [c.finish_reason for c in own] == [None] * (len(own) - 1) + [choice.finish_reason]


def test_a_stream_takes_prompt_logprobs_0_and_sends_none_as_vllm(serve_batches):
    """vLLM's stream chunks have no prompt_logprobs: it refuses k > 0 in a stream (a 400, above)
    and takes 0, which sends nothing."""
    client = serve_batches().client()
    extra = {"prompt_logprobs": 0}
    greedy = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    for create_call, args in (
        (client.chat.completions.create, {"messages": MESSAGES}),
        (client.completions.create, {"prompt": "Hello"}),
    ):
        whole = create_call(**greedy, **args).model_dump()
        stream = create_call(**greedy, **args, extra_body=extra, stream=True)
        chunks = [chunk.model_dump() for chunk in stream]
        assert chunks and all("prompt_logprobs" not in chunk for chunk in chunks)
        assert all("prompt_logprobs" not in c["choices"][0] for c in chunks)
        (choice,) = whole["choices"]
        if "message" in choice:
            text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks)
            assert text == choice["message"]["content"]
        else:
            assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


@pytest.mark.parametrize("door", ["realtime", "batch"])
def test_best_of_returns_the_n_likeliest_of_best_of_samples(serve_batches, door):
    client = serve_batches().client()
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "seed": 5}
    # The same seeds sample the same completions: best_of's are among n=4's, the likeliest two.
    every = client.completions.create(**body, n=4, logprobs=0).choices
    likeliest = sorted(every, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)[:2]
    if door == "realtime":
        best = client.completions.create(**body, n=2, best_of=4).model_dump()
    else:
        line = {"custom_id": "best", "method": "POST", "url": "/v1/completions"}
        line["body"] = {**body, "n": 2, "best_of": 4}
        batch = finished(client, create(client, [line], endpoint="/v1/completions").id)
        (result,) = read_lines(client, batch.output_file_id)
        best = result["response"]["body"]
    assert [c["text"] for c in best["choices"]] == [c.text for c in likeliest]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])  # not asked for
    # All four were generated, and are counted.
    assert best["usage"]["completion_tokens"] == sum(len(c.logprobs.tokens) for c in every)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 21}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"logprobs": 6}, "logprobs"),
    ],
)
def test_bad_echo_and_best_of_are_400s(serve_batches, body, param):
    client = serve_batches().client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2, extra_body=body)
    assert caught.value.body["param"] == param


@torch.inference_mode()
def expected_beams(model_dir: Path, prompt: list[int], width: int, length_penalty: float):
    """transformers' beams, best first, as token ids after the prompt (no end token)."""
    ids = torch.tensor([prompt])
    out = _oracle(model_dir).generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=6,
        do_sample=False,
        early_stopping=True,
        length_penalty=length_penalty,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, len(prompt) :].tolist()


@pytest.mark.parametrize("door", ["realtime", "batch"])
def test_beam_search_equals_transformers_num_beams(serve_batches, tiny_llama, door):
    client = serve_batches().client()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = [1, 3251, 338, 263, 1243, 310, 278, 9853, 3402]
    beams = {"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True}
    body = {"model": "tiny", "max_tokens": 6, "n": 3}
    if door == "realtime":
        completion = client.completions.create(prompt=prompt, extra_body=beams, **body)
        completion = completion.model_dump()
        chat = client.chat.completions.create(messages=MESSAGES, extra_body=beams, **body)
        chat = chat.model_dump()
    else:
        lines = [
            {"url": "/v1/chat/completions", "body": {**body, **beams, "messages": MESSAGES}},
            {"url": "/v1/completions", "body": {**body, **beams, "prompt": prompt}},
        ]
        for line in lines:
            line.update(custom_id=line["url"], method="POST")
        chat_batch = finished(client, create(client, lines[:1]).id)
        completion_batch = finished(
            client, create(client, lines[1:], endpoint="/v1/completions").id
        )
        (chat,) = read_lines(client, chat_batch.output_file_id)
        (completion,) = read_lines(client, completion_batch.output_file_id)
        chat, completion = chat["response"]["body"], completion["response"]["body"]
    expected = expected_beams(tiny_llama, prompt, 3, 0.5)
    assert [c["text"] for c in completion["choices"]] == [
        tokenizer.decode(beam, skip_special_tokens=True) for beam in expected
    ]
    assert [c["finish_reason"] for c in completion["choices"]] == ["length"] * 3
    expected = expected_beams(tiny_llama, chat_prompt(tiny_llama), 3, 0.5)
    assert [c["message"]["content"] for c in chat["choices"]] == [
        tokenizer.decode(beam, skip_special_tokens=True) for beam in expected
    ]


def test_a_chat_beam_search_streams_its_beams_whole_as_vllm(serve_batches):
    """vLLM's chat streams a beam search (its completions refuse it, below): the beams are
    known at the end, so each choice arrives as one chunk with its whole text and its finish."""
    client = serve_batches().client()
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "n": 3}
    beams = {"use_beam_search": True, "length_penalty": 0.5, "ignore_eos": True}
    options = {"include_usage": True}
    whole = client.chat.completions.create(**body, extra_body=beams)
    stream = client.chat.completions.create(
        **body, extra_body=beams, stream=True, stream_options=options
    )
    chunks = list(stream)
    *choices, last = chunks
    assert sorted(chunk.choices[0].index for chunk in choices) == [0, 1, 2]
    for chunk in choices:
        (streamed,) = chunk.choices
        expected = whole.choices[streamed.index]
        assert streamed.delta.role == "assistant"
        assert streamed.delta.content == expected.message.content
        assert streamed.finish_reason == expected.finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize(
    "body, param",
    [
        ({"use_beam_search": True, "stream": True}, "use_beam_search"),
        ({"use_beam_search": True, "n": 11}, "n"),
        ({"use_beam_search": True, "n": 2, "best_of": 3}, "best_of"),
        ({"use_beam_search": True, "length_penalty": 11}, "length_penalty"),
        ({"use_beam_search": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_bad_beam_searches_are_400s(serve_batches, body, param):
    client = serve_batches().client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2, extra_body=body)
    assert caught.value.body["param"] == param

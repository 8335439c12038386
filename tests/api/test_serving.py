"""Serving: OpenAI requests into engine requests, engine outputs into OpenAI responses."""

from __future__ import annotations

from typing import Any

import pytest

from pagedbatch.engine import LLMEngine, RequestOutputKind
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.chat import ChatCompletionRequest
from pagedbatch.protocol.schemas.completions import CompletionRequest
from pagedbatch.protocol.serving.chat import prepare_chat
from pagedbatch.protocol.serving.common import Prepared, parse_request
from pagedbatch.protocol.serving.completions import prepare_completion


def chat(engine: LLMEngine, **fields: Any):
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "Hi"}]}
    return prepare_chat(parse_request(ChatCompletionRequest, {**body, **fields}), engine)


def completion(engine: LLMEngine, **fields: Any):
    body = {"model": engine.model_name, "prompt": "Once upon a time"}
    return prepare_completion(parse_request(CompletionRequest, {**body, **fields}), engine)


def generate(engine: LLMEngine, prepared: Prepared) -> list[RequestOutput]:
    for engine_input in prepared.inputs:
        engine.add_request(
            engine_input.request_id, engine_input.prompt_token_ids, engine_input.params
        )
    done: dict[str, RequestOutput] = {}
    while len(done) < len(prepared.inputs):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[i.request_id] for i in prepared.inputs]


def respond(engine: LLMEngine, prepared: Prepared) -> dict[str, Any]:
    return prepared.response(generate(engine, prepared)).model_dump(mode="json")


def refusal(prepare, engine: LLMEngine, **fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        prepare(engine, **fields)
    return caught.value


class TestChatPrompt:
    def test_messages_go_through_the_chat_template(self, engine):
        messages = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Tell"}, {"type": "text", "text": "more"}],
            },
        ]
        prepared = chat(engine, messages=messages)
        (engine_input,) = prepared.inputs
        assert engine.tokenizer.decode(engine_input.prompt_token_ids) == (
            "<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHello<|im_end|>\n"
            "<|im_start|>assistant\nHi.<|im_end|>\n"
            "<|im_start|>user\nTell\nmore<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        template_ids = engine.tokenizer.apply_chat_template(
            messages[:3], tokenize=False, add_generation_prompt=True
        )
        assert chat(engine, messages=messages[:3]).inputs[0].prompt_token_ids == (
            engine.tokenizer.encode(template_ids, add_special_tokens=False)
        )

    def test_sampling_params_follow_the_request(self, engine):
        params = (
            chat(
                engine,
                max_completion_tokens=7,
                max_tokens=99,
                temperature=0.5,
                top_p=0.9,
                n=3,
                stop="END",
                seed=11,
                logprobs=True,
                top_logprobs=4,
                presence_penalty=0.5,
                top_k=40,
                ignore_eos=True,
            )
            .inputs[0]
            .params
        )
        assert (params.max_tokens, params.temperature, params.top_p, params.n) == (7, 0.5, 0.9, 3)
        assert (params.stop, params.seed, params.logprobs) == (["END"], 11, 4)
        assert (params.presence_penalty, params.top_k, params.ignore_eos) == (0.5, 40, True)

    def test_max_tokens_defaults_to_the_rest_of_the_context(self, engine):
        assert chat(engine).inputs[0].params.max_tokens is None
        assert chat(engine, max_tokens=5).inputs[0].params.max_tokens == 5
        assert chat(engine, logprobs=True).inputs[0].params.logprobs == 0

    def test_top_p_zero_keeps_only_the_most_likely_token(self, engine):
        params = chat(engine, top_p=0).inputs[0].params
        assert (params.top_p, params.top_k) == (1.0, 1)

    def test_a_prompt_beyond_the_context_is_refused_with_the_lengths(self, engine):
        prompt_len = len(chat(engine).inputs[0].prompt_token_ids)
        error = refusal(chat, engine, max_tokens=engine.max_model_len)
        assert (error.status_code, error.detail.code) == (400, "context_length_exceeded")
        assert error.detail.param == "messages"
        assert f"maximum context length is {engine.max_model_len} tokens" in error.detail.message
        assert f"{prompt_len} in the messages, {engine.max_model_len} in the completion" in (
            error.detail.message
        )

    def test_an_unknown_model_is_not_found(self, engine):
        error = refusal(chat, engine, model="gpt-4o")
        assert (error.status_code, error.detail.code, error.detail.param) == (
            404,
            "model_not_found",
            "model",
        )

    def test_audio_output_is_a_clear_400(self, engine):
        error = refusal(chat, engine, audio={"voice": "alloy", "format": "wav"})
        assert (error.status_code, error.detail.param) == (400, "audio")
        assert "not supported" in error.detail.message

    def test_audio_input_to_a_text_only_model_is_a_clear_400(self, engine):
        part = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
        error = refusal(
            chat,
            engine,
            messages=[{"role": "user", "content": [{"type": "text", "text": "?"}, part]}],
        )
        assert (error.status_code, error.detail.param) == (400, "messages[0].content[1]")
        assert error.detail.message == "This model takes no audio clips."

    def test_a_text_response_format_is_fine(self, engine):
        assert chat(engine, response_format={"type": "text"}).inputs

    def test_logit_bias_steers_sampling(self, engine):
        token = engine.tokenizer.encode(" castle", add_special_tokens=False)[0]
        prepared = chat(engine, logit_bias={str(token): 100}, max_tokens=4, ignore_eos=True)
        (output,) = generate(engine, prepared)
        assert output.outputs[0].token_ids == [token] * 4

    def test_logit_bias_outside_the_vocabulary_is_refused(self, engine):
        assert refusal(chat, engine, logit_bias={"999999": 1}).detail.param == "logit_bias"


class TestChatResponse:
    def test_every_field_openai_emits(self, engine):
        prepared = chat(engine, temperature=0, max_tokens=5, ignore_eos=True)
        (output,) = generate(engine, prepared)
        body = prepared.response([output]).model_dump(mode="json")
        assert set(body) == {
            "id",
            "object",
            "created",
            "model",
            "choices",
            "usage",
            "system_fingerprint",
            "service_tier",
        }
        assert body["id"].startswith("chatcmpl-")
        assert body["object"] == "chat.completion"
        assert isinstance(body["created"], int)
        assert body["model"] == engine.model_name
        (choice,) = body["choices"]
        assert choice == {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": output.outputs[0].text,
                "refusal": None,
                "annotations": [],
                "tool_calls": None,
                "function_call": None,
                "audio": None,
            },
            "finish_reason": "length",
            "logprobs": None,
        }
        prompt_tokens = len(prepared.inputs[0].prompt_token_ids)
        assert body["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 5,
            "total_tokens": prompt_tokens + 5,
            "prompt_tokens_details": {
                "cached_tokens": output.num_cached_tokens,
                "audio_tokens": 0,
                "image_tokens": 0,
            },
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        }

    def test_n_choices_and_their_usage(self, engine):
        body = respond(engine, chat(engine, n=3, max_tokens=4, ignore_eos=True, seed=1))
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == 12

    def test_a_repeated_prompt_reports_cached_tokens(self, engine):
        long_history = [{"role": "user", "content": "tell me a long story " * 8}]
        first = respond(engine, chat(engine, messages=long_history, max_tokens=2))
        second = respond(engine, chat(engine, messages=long_history, max_tokens=2))
        assert first["usage"]["prompt_tokens"] > 32
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 16 <= cached <= second["usage"]["prompt_tokens"]

    def test_logprobs_in_openais_shape(self, engine):
        prepared = chat(engine, logprobs=True, top_logprobs=3, max_tokens=6, ignore_eos=True)
        (output,) = generate(engine, prepared)
        content = prepared.response([output]).model_dump(mode="json")["choices"][0]["logprobs"][
            "content"
        ]
        assert len(content) == len(output.outputs[0].token_ids) == 6
        for entry, token_id in zip(content, output.outputs[0].token_ids, strict=True):
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert entry["logprob"] <= 0
            assert len(entry["top_logprobs"]) == 3
            top = [t["logprob"] for t in entry["top_logprobs"]]
            assert top == sorted(top, reverse=True)
            assert entry["logprob"] <= top[0]
            if "\ufffd" not in entry["token"]:  # a whole character or more
                assert entry["token"] == engine.tokenizer.decode(
                    [token_id], skip_special_tokens=False
                )
        # A token may hold part of a character; the bytes of all tokens join into the exact text.
        joined = b"".join(bytes(entry["bytes"]) for entry in content).decode()
        assert joined == engine.tokenizer.decode(
            output.outputs[0].token_ids, skip_special_tokens=False
        )

    def test_an_aborted_request_is_an_error_not_a_response(self, engine):
        prepared = chat(engine, max_tokens=50, ignore_eos=True)
        (engine_input,) = prepared.inputs
        engine.add_request(
            engine_input.request_id, engine_input.prompt_token_ids, engine_input.params
        )
        engine.step()
        engine.abort_request(engine_input.request_id)
        (output,) = [o for o in engine.step() if o.request_id == engine_input.request_id]
        with pytest.raises(OpenAIError) as caught:
            prepared.response([output])
        assert (caught.value.status_code, caught.value.detail.type) == (503, "server_error")


class TestCompletions:
    def test_every_field_openai_emits(self, engine):
        prepared = completion(engine, temperature=0, ignore_eos=True)
        (output,) = generate(engine, prepared)
        body = prepared.response([output]).model_dump(mode="json")
        assert set(body) == {
            "id",
            "object",
            "created",
            "model",
            "choices",
            "usage",
            "system_fingerprint",
        }
        assert body["id"].startswith("cmpl-")
        assert body["object"] == "text_completion"
        assert body["choices"] == [
            {
                "index": 0,
                "text": output.outputs[0].text,
                "finish_reason": "length",
                "logprobs": None,
            }
        ]
        prompt_tokens = len(engine.tokenizer.encode("Once upon a time"))
        assert body["usage"]["prompt_tokens"] == prompt_tokens
        assert body["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens

    def test_several_prompts_number_their_choices_in_order(self, engine):
        prepared = completion(engine, prompt=["a cat", "the dog"], n=2, max_tokens=3, seed=0)
        prompt_ids = [engine.tokenizer.encode(p) for p in ("a cat", "the dog")]
        assert [i.prompt_token_ids for i in prepared.inputs] == prompt_ids
        body = respond(engine, prepared)
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert body["usage"]["prompt_tokens"] == sum(map(len, prompt_ids))

    def test_token_id_prompts_go_in_as_they_are(self, engine):
        prepared = completion(engine, prompt=[[5, 6, 7], [8]])
        assert [i.prompt_token_ids for i in prepared.inputs] == [[5, 6, 7], [8]]
        assert completion(engine, prompt=[9, 10]).inputs[0].prompt_token_ids == [9, 10]

    def test_echo_puts_the_prompt_before_the_text(self, engine):
        prepared = completion(engine, prompt="The sky is", echo=True, max_tokens=3, temperature=0)
        (output,) = generate(engine, prepared)
        text = prepared.response([output]).choices[0].text
        assert text == "The sky is" + output.outputs[0].text

    def test_logprobs_in_the_legacy_shape(self, engine):
        prepared = completion(engine, logprobs=2, max_tokens=5, ignore_eos=True)
        (output,) = generate(engine, prepared)
        logprobs = prepared.response([output]).choices[0].logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
        assert all(len(top) <= 2 for top in logprobs.top_logprobs)
        # Each offset is where the token's text starts in the choice's text.
        text = output.outputs[0].text
        assert logprobs.text_offset[0] == 0
        for token, start in zip(logprobs.tokens, logprobs.text_offset, strict=True):
            if "\ufffd" not in token:
                assert text[start : start + len(token)] == token

    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"suffix": "x"}, "suffix"),
            ({"best_of": 3, "stream": True}, "best_of"),
            ({"max_tokens": 10_000}, "prompt"),
        ],
    )
    def test_refusals(self, engine, fields, param):
        error = refusal(completion, engine, **fields)
        assert (error.status_code, error.detail.param) == (400, param)


@pytest.mark.parametrize("prepare", [chat, completion])
def test_a_stream_asks_the_engine_for_deltas_and_a_whole_response_for_the_final_output(
    engine, prepare
):
    # Neither copies a request's whole output each step: a stream sends what is new, a whole
    # response needs only the end.
    (streamed,) = prepare(engine, stream=True).inputs
    (whole,) = prepare(engine).inputs
    assert streamed.params.output_kind is RequestOutputKind.DELTA
    assert whole.params.output_kind is RequestOutputKind.FINAL_ONLY

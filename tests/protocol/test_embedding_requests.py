"""`/v1/embeddings` requests checked and prepared before any engine work: every bad input is a
400 naming its field (`input`, `input[3]`, `dimensions`, `model`), each input becomes one pooling
request of the model's own tokenization ([CLS] ... [SEP]) that must fit its context whole, and a
model of the wrong kind is refused on either side (an embedding model asked to generate, a
generating one asked for embeddings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedbatch.engine import EngineArgs, LLMEngine
from pagedbatch.engine.pooling_params import PoolingParams
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.chat import ChatCompletionRequest
from pagedbatch.protocol.schemas.completions import CompletionRequest
from pagedbatch.protocol.schemas.embeddings import MAX_EMBEDDING_INPUTS, EmbeddingRequest
from pagedbatch.protocol.serving.chat import prepare_chat
from pagedbatch.protocol.serving.common import parse_request, worst_case_tokens
from pagedbatch.protocol.serving.completions import prepare_completion
from pagedbatch.protocol.serving.embeddings import (
    MAX_EMBEDDING_TOKENS,
    PreparedEmbedding,
    prepare_embedding,
)

TEXTS = ["A first sentence.", "And a second, somewhat longer one.", "Third."]


@pytest.fixture(scope="module")
def bert(make_checkpoint) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(make_checkpoint("bert"))))


@pytest.fixture(scope="module")
def matryoshka(make_checkpoint) -> LLMEngine:
    path = make_checkpoint("bert", matryoshka_dimensions=[16, 32])
    return LLMEngine(EngineArgs(model=str(path)))


@pytest.fixture(scope="module")
def llama(tiny_llama: Path) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(tiny_llama), num_kv_blocks=16))


def prepare(served: LLMEngine, **body: Any) -> PreparedEmbedding:
    request = parse_request(EmbeddingRequest, {"model": served.model_name, **body})
    return prepare_embedding(request, served)


def refusal(served: LLMEngine, **body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        prepare(served, **body)
    return caught.value


def test_each_input_is_one_pooling_request_tokenized_as_the_model_does(bert):
    tokenizer = bert.tokenizer
    prepared = prepare(bert, input=TEXTS)
    assert [i.prompt_token_ids for i in prepared.inputs] == [
        tokenizer.encode(text, add_special_tokens=True) for text in TEXTS
    ]
    for engine_input in prepared.inputs:
        assert isinstance(engine_input.params, PoolingParams)
        assert engine_input.params.dimensions is None
        ids = engine_input.prompt_token_ids
        assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
    assert len({i.request_id for i in prepared.inputs}) == len(TEXTS)
    # Token ids, one list or several, are taken as they are.
    ids = [i.prompt_token_ids for i in prepared.inputs]
    assert [i.prompt_token_ids for i in prepare(bert, input=ids).inputs] == ids
    assert [i.prompt_token_ids for i in prepare(bert, input=ids[1]).inputs] == [ids[1]]
    assert [i.prompt_token_ids for i in prepare(bert, input=TEXTS[2]).inputs] == [ids[2]]
    # Spend limits reserve the prompts alone: an embedding generates nothing.
    assert worst_case_tokens(prepared, bert.max_model_len) == (sum(map(len, ids)), 0)
    # Nothing of an embedding request is screened by the content filter.
    assert prepared.input_texts() == []


def long_text(served: LLMEngine, tokens: int) -> str:
    """A text of exactly `tokens` tokens, with the model's special tokens."""
    words = " ".join(["word"] * tokens)
    ids = served.tokenizer.encode(words, add_special_tokens=True)
    while len(ids) > tokens:
        words = words.rsplit(" ", 1)[0]
        ids = served.tokenizer.encode(words, add_special_tokens=True)
    assert len(ids) == tokens
    return words


def test_an_input_must_fit_the_context_whole(bert):
    limit = bert.max_model_len
    fits = long_text(bert, limit)
    assert len(prepare(bert, input=fits).inputs[0].prompt_token_ids) == limit
    one_more = fits + " word"
    error = refusal(bert, input=["short", one_more])
    assert (error.status_code, error.detail.param) == (400, "input[1]")
    assert error.detail.code == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens" in str(error)
    # Far past the context, a text is refused after counting about a context's worth of it.
    error = refusal(bert, input="word " * 400_000)
    assert (error.detail.param, error.detail.code) == ("input", "context_length_exceeded")
    assert "at least" in str(error)
    ids = list(range(5, 5 + limit + 1))
    assert refusal(bert, input=[ids[:3], ids]).detail.param == "input[1]"


def test_the_inputs_together_are_bounded_in_tokens(bert):
    fits = long_text(bert, bert.max_model_len)
    inputs = [fits] * (MAX_EMBEDDING_TOKENS // bert.max_model_len + 1)
    assert len(inputs) <= MAX_EMBEDDING_INPUTS
    error = refusal(bert, input=inputs)
    assert (error.status_code, error.detail.param) == (400, "input")
    assert f"at most {MAX_EMBEDDING_TOKENS} tokens" in str(error)


VOCAB = "VOCAB"  # in a body below: the vocabulary's size, the first id outside it


def resolved(value: Any, vocab: int) -> Any:
    if value == VOCAB:
        return vocab
    return [resolved(v, vocab) for v in value] if isinstance(value, list) else value


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"input": ""}, "input", "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": ["fine", ""]}, "input[1]", "invalid_value"),
        ({"input": [[1, 2], []]}, "input[1]", "invalid_value"),
        ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "input", "invalid_value"),
        ({"input": [5, -1]}, "input[1]", "invalid_value"),
        ({"input": ["text", 5]}, "input[1]", "invalid_type"),
        ({"input": [1, 2, VOCAB]}, "input", "invalid_value"),
        ({"input": [[5], [6, VOCAB]]}, "input[1]", "invalid_value"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "invalid_value"),
        ({"input": "x", "dimensions": 0}, "dimensions", "invalid_value"),
        ({"input": "x", "dimensions": 8}, "dimensions", "invalid_value"),
        ({"input": "x", "stream": True}, "stream", "unknown_parameter"),
        ({"input": "x", "user": "u" * 257}, "user", "invalid_value"),
        ({}, "input", "missing_required_parameter"),
    ],
    ids=[
        "empty",
        "no-inputs",
        "empty-among-texts",
        "empty-among-token-lists",
        "too-many",
        "negative-token",
        "mixed",
        "outside-vocabulary",
        "outside-vocabulary-among-lists",
        "encoding",
        "zero-dimensions",
        "not-matryoshka",
        "stream",
        "long-user",
        "no-input",
    ],
)
def test_bad_input_is_a_400_naming_the_field(bert, body, param, code):
    vocab = len(bert.tokenizer)
    error = refusal(bert, **{name: resolved(value, vocab) for name, value in body.items()})
    assert (error.status_code, error.detail.param, error.detail.code) == (400, param, code)


def test_a_matryoshka_model_cuts_to_the_sizes_it_was_trained_for(matryoshka):
    assert prepare(matryoshka, input="x", dimensions=16).inputs[0].params.dimensions == 16
    full = matryoshka.pooling.dimensions
    assert prepare(matryoshka, input="x", dimensions=full).inputs[0].params.dimensions is None
    for size in (8, full + 1):
        error = refusal(matryoshka, input="x", dimensions=size)
        assert (error.status_code, error.detail.param) == (400, "dimensions")


def test_a_model_of_the_other_kind_is_refused_naming_the_model(bert, llama):
    error = refusal(llama, input="x")
    assert (error.status_code, error.detail.param) == (400, "model")
    assert "gives no embeddings" in str(error)
    assert refusal(bert, input="x", model="someone-elses").status_code == 404
    name = bert.model_name
    chat = {"model": name, "messages": [{"role": "user", "content": "Hi"}]}
    completion = {"model": name, "prompt": "Hi"}
    for prepare_generation, schema, body in [
        (prepare_chat, ChatCompletionRequest, chat),
        (prepare_completion, CompletionRequest, completion),
    ]:
        with pytest.raises(OpenAIError) as caught:
            prepare_generation(parse_request(schema, body), bert)
        assert (caught.value.status_code, caught.value.detail.param) == (400, "model")
        assert "is an embedding model" in str(caught.value)

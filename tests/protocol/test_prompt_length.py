"""A prompt's length is checked without tokenizing all of a text far past the context: such a
prompt is refused (400 context_length_exceeded) after about a context's worth of tokenizing, in
time and in memory, however long it is; a long prompt that fits still gets its exact token ids,
and one token more than fits is still refused."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
from memory import peak_rss_growth
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.chat import ChatCompletionRequest
from pagedbatch.protocol.schemas.completions import CompletionRequest
from pagedbatch.protocol.serving.chat import prepare_chat, render_chat
from pagedbatch.protocol.serving.common import PIECE_CHARS
from pagedbatch.protocol.serving.completions import prepare_completion

CONTEXT = 2048
WORDS = [
    "lorem",
    "ipsum",
    "dolor",
    "sit",
    "amet",
    "consectetur",
    "adipiscing",
    "elit",
    "sed",
    "do",
    "eiusmod",
    "tempor",
]


@dataclass
class Served:
    """The ServedModel interface (protocol/serving/common.py) over a checkpoint's tokenizer:
    preparing a text-only request needs no engine."""

    tokenizer: Any
    max_model_len: int = CONTEXT
    model_name: str = "tiny"
    reasoning_tags: tuple[str, str] | None = None
    labels: list[str] | None = None
    image_processor: None = None
    audio_processor: None = None
    pooling: None = None
    lora_names: tuple[str, ...] = ()


class CountingTokenizer:
    """A tokenizer that counts the characters it is given to encode."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.encoded_chars = 0

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded_chars += len(text)
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def prose(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = []
    total = 0
    while total < chars:
        word = f"{rng.choice(WORDS)}{rng.randrange(1000)}"
        words.append(word)
        total += len(word) + 1
    return " ".join(words)[:chars]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llama)


def chat(messages: list[str], **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": m} for m in messages], **fields}
    )


def test_a_chat_far_past_the_context_is_refused_after_tokenizing_about_a_context(tokenizer):
    # 30 messages of 65,000 characters: the 1.95 MB of text a 2 MiB body holds.
    counting = CountingTokenizer(tokenizer)
    request = chat([prose(65_000, seed) for seed in range(30)])
    with pytest.raises(OpenAIError) as caught:
        prepare_chat(request, Served(counting))
    error = caught.value.body()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert "resulted in at least" in error["message"]
    # One piece holds far more than the context's 2,048 tokens: one piece was enough.
    assert counting.encoded_chars <= PIECE_CHARS < 1_950_000 // 20


def test_a_completion_prompt_far_past_the_context_is_refused_the_same_way(tokenizer):
    counting = CountingTokenizer(tokenizer)
    request = CompletionRequest.model_validate(
        {"model": "tiny", "prompt": prose(1_000_000), "max_tokens": 16}
    )
    with pytest.raises(OpenAIError) as caught:
        prepare_completion(request, Served(counting))
    error = caught.value.body()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert "you requested at least" in error["message"]
    assert counting.encoded_chars <= PIECE_CHARS


def test_a_long_prompt_that_fits_gets_its_exact_ids_and_one_token_more_is_refused(tokenizer):
    """Counting in pieces refuses nothing that fits: at the exact bound the prompt is accepted
    with the whole text's ids; one token short of room, it is refused by the exact count."""
    request = chat([prose(150_000, 7), prose(120_000, 8)])
    text = render_chat(request.messages, tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(text) > 4 * PIECE_CHARS  # counted in several pieces first
    prepared = prepare_chat(request, Served(tokenizer, max_model_len=len(ids) + 1))
    assert prepared.inputs[0].prompt_token_ids == ids
    with pytest.raises(OpenAIError) as caught:
        prepare_chat(request, Served(tokenizer, max_model_len=len(ids)))
    message = caught.value.body()["error"]["message"]
    assert f"resulted in {len(ids)} tokens" in message  # the exact count, not an estimate


MEASURE = """
from transformers import AutoTokenizer
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.chat import ChatCompletionRequest
from pagedbatch.protocol.serving.chat import prepare_chat
from test_prompt_length import Served, prose
tokenizer = AutoTokenizer.from_pretrained({checkpoint!r})
request = ChatCompletionRequest.model_validate(
    {{"model": "tiny", "messages": [{{"role": "user", "content": prose(65_000, seed)}}
                                    for seed in range(30)]}}
)
def work():
    try:
        prepare_chat(request, Served(tokenizer))
    except OpenAIError as e:
        return e.body()["error"]["code"]
"""


def test_refusing_a_chat_far_past_the_context_takes_little_memory(tiny_llama):
    """The peak RSS (VmHWM, reset first) of a process of its own: tokenizing those 1.95 MB
    whole grows it by about 500 MB (and a 58 MB line by gigabytes); counting a piece, by a few."""
    code, grown_kib = peak_rss_growth(MEASURE.format(checkpoint=str(tiny_llama)), __file__)
    assert code == "context_length_exceeded"
    assert grown_kib < 64 * 1024

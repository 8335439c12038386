"""Trained GGUF checkpoints served as they are: greedy chat answers equal transformers' own GGUF
loading of the same file, token for token, ending on the model's own end token. In exact mode
(quantization none), as transformers dequantizes the weights; the kept blocks are checked against
exact mode in tests/engine/worker/test_quantized_gguf.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from real_models import CHATS, FEW_SHOT_FRANCE, INSTRUCT, MAX_TOKENS, MODELS, transformers_greedy

from pagedbatch.engine import LLM, SamplingParams

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, real_model) -> tuple[str, Path, LLM]:
    gguf_file = real_model(request.param)
    llm = LLM(
        gguf_file, num_kv_blocks=512, chat_template=MODELS[request.param], quantization="none"
    )
    return request.param, gguf_file, llm


def chat_prompt(llm: LLM, chat: list[dict[str, str]]) -> list[int]:
    """The prompt's ids as the chat endpoint makes them: the template adds any special tokens."""
    text = llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_greedy_chats_equal_transformers_and_end_on_the_models_end_token(served):
    name, gguf_file, llm = served
    eos = sorted(llm.engine.eos_token_ids)
    prompts = [chat_prompt(llm, chat) for chat in CHATS]
    outputs = [request.outputs[0] for request in llm.generate(prompts, GREEDY)]
    for chat, prompt, output in zip(CHATS, prompts, outputs, strict=True):
        assert output.token_ids == transformers_greedy(gguf_file, prompt, eos), chat
        if output.finish_reason == "stop":
            assert output.token_ids[-1] in eos
    if name in INSTRUCT:
        assert sum(o.finish_reason == "stop" for o in outputs) >= len(CHATS) // 2
        assert "Paris" in outputs[0].text
    else:
        (answer,) = llm.generate([FEW_SHOT_FRANCE], SamplingParams(temperature=0, max_tokens=3))
        assert answer.outputs[0].text.startswith(" Paris")

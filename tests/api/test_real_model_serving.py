"""Trained GGUF models served by path through the whole service: the `openai` SDK's chat answers
and batch lines equal transformers' greedy output on the same chat template, end on the model's own
end token, and report exact usage. The chat model (SmolLM2) is served here; Gemma 3 270M, a base
model, is served without a chat template, and its tokens under a template setting are checked
against transformers' in tests/engine/test_real_models.py."""

from __future__ import annotations

import json

import openai
import pytest
from real_models import CHATS, FEW_SHOT_FRANCE, MAX_TOKENS, transformers_greedy
from servers import wait_for_batch

pytestmark = pytest.mark.real_model

BATCH_CHATS = CHATS[:3]


@pytest.fixture
def served(serve_batches, real_model):
    gguf_file = real_model("smollm2-135m-instruct")
    # Exact mode, as transformers dequantizes the weights.
    server = serve_batches(model=str(gguf_file), served_model_name=None, quantization="none")
    return gguf_file, server


def expected(server, gguf_file, chat) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy completion ids) for one chat."""
    engine = server.embedded.context.engine.engine
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    return prompt, transformers_greedy(gguf_file, prompt, sorted(engine.eos_token_ids))


def test_chat_and_batch_answers_equal_transformers(served):
    gguf_file, server = served
    client = server.client()
    (model,) = [m.id for m in client.models.list()]
    assert model == gguf_file.stem
    tokenizer = server.embedded.context.engine.engine.tokenizer
    answers = []
    for chat in BATCH_CHATS:
        prompt, completion = expected(server, gguf_file, chat)
        response = client.chat.completions.create(
            model=model, messages=chat, temperature=0, max_tokens=MAX_TOKENS
        )
        choice = response.choices[0]
        ends_on_eos = choice.finish_reason == "stop"
        text_ids = completion[:-1] if ends_on_eos else completion
        assert choice.message.content == tokenizer.decode(text_ids, skip_special_tokens=True)
        assert response.usage.prompt_tokens == len(prompt)
        assert response.usage.completion_tokens == len(completion)
        answers.append(choice.message.content)
    assert "Paris" in answers[0]

    lines = [
        {
            "custom_id": f"chat-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": chat, "temperature": 0, "max_tokens": MAX_TOKENS},
        }
        for i, chat in enumerate(BATCH_CHATS)
    ]
    upload = client.files.create(
        file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_for_batch(client, batch.id, lambda b: b.status == "completed", 300)
    output = [
        json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()
    ]
    by_id = {line["custom_id"]: line["response"]["body"] for line in output}
    assert [by_id[f"chat-{i}"]["choices"][0]["message"]["content"] for i in range(3)] == answers


def test_a_model_without_a_chat_template_refuses_chat_but_completes(serve_batches, real_model):
    server = serve_batches(model=str(real_model("gemma-3-270m")), served_model_name="gemma")
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="gemma", messages=CHATS[0], max_tokens=4)
    assert refused.value.status_code == 400
    assert "no chat template" in refused.value.message
    completion = client.completions.create(
        model="gemma", prompt=FEW_SHOT_FRANCE, temperature=0, max_tokens=3
    )
    assert completion.choices[0].text.startswith(" Paris")

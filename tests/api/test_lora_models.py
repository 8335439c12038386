"""LoRA adapters at the doors (issue 35): /v1/models lists each served adapter with its
`parent`; a request names an adapter as its model, realtime and in a batch line, and gets the
engine's output for that adapter (whose tokens equal transformers + peft's: test_multi_lora)."""

from __future__ import annotations

from pathlib import Path

import pytest
from greedy_checks import random_prompts
from lora_adapters import ATTENTION, MLP, make_adapter
from test_batches import create, finished, results

from pagedbatch.engine import LLM, SamplingParams

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("r8"), 8, 16, ATTENTION + MLP, seed=3)


def test_adapters_are_listed_and_picked_by_model_name_on_both_doors(
    serve_batches, tiny_llama, adapter
):
    server = serve_batches(lora_modules=f"tiny-r8={adapter}")
    client = server.client()
    models = {m.id: m for m in client.models.list()}
    assert list(models) == ["tiny", "tiny-r8"]
    assert (models["tiny"].parent, models["tiny-r8"].parent) == (None, "tiny")
    assert client.models.retrieve("tiny-r8").parent == "tiny"

    prompt = random_prompts(1, 10, 10, seed=21)[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = LLM(tiny_llama, lora_modules=f"tiny-r8={adapter}", num_kv_blocks=64)
    [expected, base] = offline.generate([prompt, prompt], params, lora_name=["tiny-r8", None])
    assert expected.text != base.text

    def complete(model: str) -> str:
        answer = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return answer.choices[0].text

    assert (complete("tiny-r8"), complete("tiny")) == (expected.text, base.text)

    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    lines = [
        {"custom_id": "r8", "method": "POST", "url": "/v1/completions", "body": body}
        | {"body": {**body, "model": "tiny-r8"}}
    ]
    batch = finished(client, create(client, lines, endpoint="/v1/completions").id)
    [line], _ = results(client, batch)
    assert line["response"]["body"]["choices"][0]["text"] == expected.text


def test_an_adapter_may_not_take_the_model_name(tiny_llama, adapter):
    with pytest.raises(ValueError, match="has the model's own name"):
        LLM(tiny_llama, served_model_name="tiny", lora_modules=f"tiny={adapter}")

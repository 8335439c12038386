"""LoRA adapters at the doors (issue 35): /v1/models lists each served adapter with its
`parent`; a request names an adapter as its model, realtime and in a batch line, and gets the
engine's output for that adapter (whose tokens equal transformers + peft's: test_multi_lora)."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
from greedy_checks import random_prompts
from lora_adapters import ATTENTION, MLP, make_adapter
from servers import eventually
from test_batches import create, finished, results

from pagedbatch.engine import LLM, SamplingParams

MAX_TOKENS = 8
ADMIN = "root"


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("r8"), 8, 16, ATTENTION + MLP, seed=3)


def test_adapters_are_listed_and_picked_by_model_name_on_both_doors(
    serve_batches, tiny_llama, adapter
):
    began = int(time.time())
    price = {"input": 1.0, "output": 2.0}
    server = serve_batches(
        lora_modules=f"tiny-r8={adapter}", admin_keys=ADMIN, prices={"tiny": price}
    )
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

    # Usage and costs are the adapter's own, under its name; at its model's price, which it
    # takes where the prices leave it out.
    admin = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", admin_api_key=ADMIN, max_retries=0
    )
    usage = admin.admin.organization.usage

    def by_model() -> dict[str, tuple[int, int]]:
        page = usage.completions(start_time=began, group_by=["model", "batch"])
        return {
            (r.model, r.batch): (r.output_tokens, r.num_model_requests)
            for b in page.data
            for r in b.results
        }

    eventually(
        lambda: (
            by_model()
            == {
                ("tiny-r8", False): (MAX_TOKENS, 1),
                ("tiny", False): (MAX_TOKENS, 1),
                ("tiny-r8", True): (MAX_TOKENS, 1),
            }
        ),
        timeout=10,
    )
    page = usage.costs(start_time=began, group_by=["line_item"])
    items = {r.line_item: r.amount.value for b in page.data for r in b.results}
    assert items["tiny-r8, output"] == pytest.approx(MAX_TOKENS * price["output"] / 1e6)


def test_an_adapter_may_not_take_the_model_name(tiny_llama, adapter):
    with pytest.raises(ValueError, match="has the model's own name"):
        LLM(tiny_llama, served_model_name="tiny", lora_modules=f"tiny={adapter}")

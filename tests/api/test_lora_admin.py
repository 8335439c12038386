"""`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (issue 35, vLLM's routes): admin
keys only; a loaded adapter is listed by /v1/models with its parent and answers requests with
the engine's output for it; bad input is an OpenAI-shaped 400 (404 for an unknown name on
unload) and changes nothing."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from greedy_checks import random_prompts
from lora_adapters import ATTENTION, make_adapter

from pagedbatch.engine import LLM, SamplingParams

ADMIN, TENANT = "root", "tenant-key"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("r8"), 8, 16, ATTENTION, seed=5)


def test_an_operator_loads_and_unloads_an_adapter(serve_batches, tiny_llama, adapter, tmp_path):
    server = serve_batches(enable_lora=True, admin_keys=ADMIN, api_keys=TENANT)
    admin = {"authorization": f"Bearer {ADMIN}"}
    tenant = {"authorization": f"Bearer {TENANT}"}
    body = {"lora_name": "mine", "lora_path": str(adapter)}

    def post(path: str, json: dict, headers: dict) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/{path}", json=json, headers=headers, timeout=60)

    def models() -> dict[str, str | None]:
        page = httpx.get(f"{server.url}/v1/models", headers=tenant).json()
        return {m["id"]: m["parent"] for m in page["data"]}

    refused = post("load_lora_adapter", body, tenant)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert models() == {"tiny": None}

    loaded = post("load_lora_adapter", body, admin)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'mine' added successfully."
    assert models() == {"tiny": None, "mine": "tiny"}

    prompt = random_prompts(1, 10, 10, seed=41)[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = LLM(tiny_llama, lora_modules=f"mine={adapter}", num_kv_blocks=64)
    [expected, base] = offline.generate([prompt, prompt], params, lora_name=["mine", None])
    assert expected.text != base.text
    request = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    answer = post("completions", {**request, "model": "mine"}, tenant)
    assert answer.json()["choices"][0]["text"] == expected.text

    for bad, param, message in [
        (body, "lora_name", "'mine' is already loaded"),
        ({"lora_name": "tiny", "lora_path": str(adapter)}, "lora_name", "the model's own name"),
        ({"lora_name": "other", "lora_path": str(tmp_path)}, "lora_path", "not a PEFT adapter"),
        ({"lora_name": "other"}, "lora_path", None),
        ({**body, "extra": 1}, "extra", None),
    ]:
        answer = post("load_lora_adapter", bad, admin)
        assert answer.status_code == 400, bad
        error = answer.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert message is None or message in error["message"]
    assert models() == {"tiny": None, "mine": "tiny"}

    gone = post("unload_lora_adapter", {"lora_name": "nope"}, admin)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_not_found"
    assert post("unload_lora_adapter", {"lora_name": "mine"}, tenant).status_code == 401
    unloaded = post("unload_lora_adapter", {"lora_name": "mine"}, admin)
    assert unloaded.status_code == 200, unloaded.text
    assert models() == {"tiny": None}
    answer = post("completions", {**request, "model": "mine"}, tenant)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_an_adapter_loaded_at_run_time_costs_what_its_model_costs(
    serve_batches, adapter: Path
) -> None:
    """Unpriced, a run-time adapter would cost nothing and pass every spend limit: it is priced
    as its model, unless the operator priced it under its own name."""
    server = serve_batches(
        enable_lora=True,
        admin_keys=ADMIN,
        api_keys=TENANT,
        prices={"tiny": {"input": 10_000.0, "output": 10_000.0}, "free": {"input": 0, "output": 0}},
        key_monthly_spend_limit_usd=0.01,  # less than one request's worst case at tiny's price
    )
    admin = {"authorization": f"Bearer {ADMIN}"}
    tenant = {"authorization": f"Bearer {TENANT}"}
    request = {"prompt": "hello", "max_tokens": MAX_TOKENS, "temperature": 0}

    def complete(model: str) -> httpx.Response:
        body = {**request, "model": model}
        return httpx.post(f"{server.url}/v1/completions", json=body, headers=tenant, timeout=60)

    for name in ("mine", "free"):
        body = {"lora_name": name, "lora_path": str(adapter)}
        loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=admin)
        assert loaded.status_code == 200, loaded.text
    for model in ("tiny", "mine"):
        refused = complete(model)
        assert refused.status_code == 429, (model, refused.text)
        assert refused.json()["error"]["code"] == "insufficient_quota"
    assert complete("free").status_code == 200

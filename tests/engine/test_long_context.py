"""Long contexts on the paged engine: greedy output token for token transformers' (sdpa, float32)
at 8K and 32K prompt tokens, chunked at the default budget and half from the prefix cache; a
128K-token prompt in bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from greedy_checks import assert_pool_whole
from transformers import AutoModelForCausalLM

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.make_model import long_context

CONTEXT = 131_072
OUTPUT = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)


@pytest.fixture(scope="module")
def long_tiny(make_checkpoint) -> Path:
    """tiny with a 128K context: YaRN from its 2,048 positions."""
    return make_checkpoint("llama", **long_context("tiny", CONTEXT))


def prompt(length: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104_729) % 16_000 + 10 for i in range(length)]


@cache
def _hf(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@torch.inference_mode()
def hf_greedy(model_dir: Path, ids: list[int]) -> list[int]:
    out = _hf(model_dir).generate(
        torch.tensor([ids]),
        max_new_tokens=OUTPUT,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    ("checkpoint", "length"),
    [("long_tiny", 8192), ("narrow_long", 32768)],
    ids=["8K", "32K"],
)
def test_long_prompts_match_transformers(request, checkpoint, length):
    """Prefilled in chunks of the default 2,048-token budget; then again with the first half of
    the prompt in the prefix cache. (32K on the one-layer tiny: on whole tiny, transformers'
    and our prefills of it take the suite minutes; the benchmark runs whole tiny that long.)"""
    model_dir = request.getfixturevalue(checkpoint)
    llm = LLM(model_dir, max_model_len=length + OUTPUT)
    ids = prompt(length)
    (out,) = llm.generate([ids], GREEDY)
    assert out.outputs[0].token_ids == hf_greedy(model_dir, ids)
    half = prompt(length // 2) + prompt(length - length // 2, seed=1)
    llm.generate([half[: length // 2]], SamplingParams(max_tokens=1))
    (again,) = llm.generate([half], GREEDY)
    assert again.num_cached_tokens >= length // 2 - 16  # whole blocks of the shared half
    assert again.outputs[0].token_ids == hf_greedy(model_dir, half)
    assert_pool_whole(llm)


def test_a_long_prefill_holds_up_neither_decodes_nor_a_new_request(narrow_long):
    engine = LLM(narrow_long, num_kv_blocks=2048).engine
    engine.add_request("decoding", prompt(8), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.add_request("long", prompt(16_384, seed=2), SamplingParams(max_tokens=1))
    generated = {"decoding": 1}
    steps = 0
    first_token_step = None
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 3:  # the long prompt is a third of the way in its prefill
            engine.add_request("short", prompt(20, seed=3), SamplingParams(max_tokens=1))
        for out in engine.step():
            count = len(out.outputs[0].token_ids)
            if out.request_id == "decoding" and not out.finished:
                assert count == generated["decoding"] + 1  # a token every step
            generated[out.request_id] = count
            if out.request_id == "short" and count and first_token_step is None:
                first_token_step = steps
            if out.request_id == "long" and out.finished:
                long_done = steps
    # Each of the long prompt's chunks left room: the short request's first token came within
    # two steps of its arrival, long before the prefill's end.
    assert first_token_step is not None and first_token_step - 3 < 2
    assert long_done > first_token_step + 2
    assert generated["long"] == 1


# A 128K prompt in a process of its own, so that its peak RSS is its own.
_RUN_128K = r"""
import json, sys
from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.worker.host_memory import peak_rss_mib
model, length, blocks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model, num_kv_blocks=blocks)
ids = [(i * 7919) % 16_000 + 10 for i in range(length)]
(out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
print(json.dumps({
    "prompt_tokens": len(out.prompt_token_ids),
    "generated": len(out.outputs[0].token_ids),
    "max_model_len": llm.engine.max_model_len,
    "kv_bytes": sum(k.nbytes + v.nbytes for k, v in llm.engine.runner.kv_caches),
    "peak_rss": int(peak_rss_mib() * 2**20),
}))
"""


def test_a_128k_prompt_completes_in_bounded_memory(narrow_long):
    model_dir = narrow_long
    length = CONTEXT - OUTPUT
    done = subprocess.run(
        [sys.executable, "-c", _RUN_128K, str(model_dir), str(length), str(CONTEXT // 16)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert (figures["prompt_tokens"], figures["generated"]) == (length, OUTPUT)
    assert figures["max_model_len"] == CONTEXT
    weights = (model_dir / "model.safetensors").stat().st_size
    budget = weights + figures["kv_bytes"] + 2**30  # a pool of 128K tokens' blocks
    print(
        f"128K prompt: peak RSS {figures['peak_rss'] / 2**20:.0f} MiB, budget (weights + KV "
        f"for 128K tokens + 1 GiB) {budget / 2**20:.0f} MiB"
    )
    assert figures["peak_rss"] < budget

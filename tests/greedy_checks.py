"""What the engine's greedy tests share: random prompts, the oracle check, the idle-pool check.

A module of its own (not conftest.py) so test modules can import these names unambiguously.
"""

from __future__ import annotations

import random

from pagedbatch.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_matches_oracle(oracle, model_dir, prompts, outputs, max_tokens=16):
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == oracle.greedy(model_dir, prompt, max_tokens)


def assert_pool_whole(llm: LLM):
    stats = llm.get_stats()
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]
    assert stats["running"] == stats["waiting"] == 0

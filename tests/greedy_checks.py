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


def assert_greedy_matches_in_every_batching(oracle, model_dir) -> None:
    """A new architecture's check, the four of test_llm.py in one engine's time: a request alone,
    then 32 of mixed lengths at once (eight of them on its prefix, read from the prefix cache),
    then eight on a pool too small for them (preempted and recomputed); each request's tokens
    equal transformers' float32 greedy ones."""
    system = random_prompts(1, 40, 40, seed=4)[0]
    prompts = random_prompts(24, 1, 80, seed=2) + [
        system + tail for tail in random_prompts(8, 1, 20, seed=5)
    ]
    expected = [oracle.greedy(model_dir, prompt, GREEDY.max_tokens) for prompt in prompts]

    llm = LLM(model_dir, num_kv_blocks=512, max_num_seqs=32)
    (alone,) = llm.generate(prompts[-1:], GREEDY)  # caches the shared prefix
    assert alone.token_ids == expected[-1]
    together = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == expected
    assert llm.get_stats()["prefix_cache_hits"] >= 8 * 32  # two full 16-token blocks, each
    assert_pool_whole(llm)

    # 10 blocks of 16 tokens cannot hold the eight longest requests (up to 96 tokens) at once.
    longest = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))[:8]
    llm = LLM(model_dir, num_kv_blocks=10, max_num_seqs=8, enable_prefix_caching=False)
    preempted = llm.generate([prompts[i] for i in longest], GREEDY)
    assert llm.get_stats()["preemptions"] > 0
    assert [o.token_ids for o in preempted] == [expected[i] for i in longest]
    assert_pool_whole(llm)

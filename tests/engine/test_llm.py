"""The engine's greedy output is token-identical to transformers' float32 `generate`, whatever the
batching, chunking, caching or preemption."""

import pytest
import torch
from greedy_checks import GREEDY, assert_matches_oracle, assert_pool_whole, random_prompts

from pagedbatch.engine import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "mistral", "gemma3"]


@pytest.fixture(params=ARCHS)
def checkpoint(request, make_checkpoint):
    return make_checkpoint(request.param)


def test_single_requests_match_transformers(checkpoint, oracle):
    llm = LLM(checkpoint, num_kv_blocks=256)
    for prompt in random_prompts(3, 1, 40, seed=1):
        (output,) = llm.generate([prompt], GREEDY)
        assert output.finish_reason == "length"
        assert_matches_oracle(oracle, checkpoint, [prompt], [output])
    assert_pool_whole(llm)


def test_concurrent_requests_of_mixed_lengths_match_transformers(checkpoint, oracle):
    prompts = random_prompts(32, 1, 120, seed=2)
    llm = LLM(checkpoint, num_kv_blocks=1024, max_num_seqs=32)
    outputs = llm.generate(prompts, GREEDY)
    assert_matches_oracle(oracle, checkpoint, prompts, outputs)
    assert_pool_whole(llm)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_prefill_with_a_tiny_token_budget_matches(make_checkpoint, oracle, arch):
    model_dir = make_checkpoint(arch)
    prompts = random_prompts(6, 20, 90, seed=3)
    llm = LLM(model_dir, num_kv_blocks=256, max_num_batched_tokens=7)
    outputs = llm.generate(prompts, GREEDY)
    assert_matches_oracle(oracle, model_dir, prompts, outputs)
    assert llm.get_stats()["steps"] > sum(map(len, prompts)) // 7


def test_shared_prefixes_hit_the_cache_and_change_nothing(checkpoint, oracle):
    system = random_prompts(1, 70, 70, seed=4)[0]
    prompts = [system + tail for tail in random_prompts(8, 1, 20, seed=5)]
    llm = LLM(checkpoint, num_kv_blocks=512)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    stats = llm.get_stats()
    assert stats["prefix_cache_hits"] >= 7 * 64  # four full 16-token blocks of the prefix, each
    assert rest[0].num_cached_tokens >= 64
    assert_matches_oracle(oracle, checkpoint, prompts, first + rest)


def test_forced_preemption_changes_nothing(checkpoint, oracle):
    prompts = random_prompts(8, 20, 60, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # 14 blocks of 16 tokens cannot hold 8 requests of up to 100 tokens at once.
    llm = LLM(checkpoint, num_kv_blocks=14, max_num_seqs=8)
    outputs = llm.generate(prompts, params)
    assert llm.get_stats()["preemptions"] > 0
    assert_matches_oracle(oracle, checkpoint, prompts, outputs, max_tokens=40)
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda s: s["rope_type"],
)
def test_rope_scaling_matches_transformers(make_checkpoint, oracle, rope_scaling):
    model_dir = make_checkpoint("llama", rope_scaling=rope_scaling, max_position_embeddings=256)
    prompts = random_prompts(4, 30, 100, seed=7)
    outputs = LLM(model_dir, num_kv_blocks=128).generate(prompts, GREEDY)
    assert_matches_oracle(oracle, model_dir, prompts, outputs)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_window_matches_transformers(make_checkpoint, oracle, arch):
    extra = {"use_sliding_window": True, "max_window_layers": 1} if arch == "qwen2" else {}
    model_dir = make_checkpoint(arch, sliding_window=24, **extra)
    prompts = random_prompts(4, 30, 70, seed=8)
    outputs = LLM(model_dir, num_kv_blocks=128, max_num_batched_tokens=32).generate(prompts, GREEDY)
    assert_matches_oracle(oracle, model_dir, prompts, outputs)


def test_logprobs_agree_with_transformers_log_softmax(tiny_qwen2, oracle):
    prompt = random_prompts(1, 30, 30, seed=9)[0]
    llm = LLM(tiny_qwen2, num_kv_blocks=64)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=5))
    expected = oracle.logprobs(tiny_qwen2, prompt, out.token_ids)
    for row, entry, token in zip(expected, out.logprobs, out.token_ids, strict=True):
        assert entry.token_id == token and entry.rank == 1
        assert abs(entry.logprob - row[token].item()) < 1e-4
        top = torch.topk(row, 5)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert (
            max(abs(lp - v) for (_, lp), v in zip(entry.top, top.values.tolist(), strict=True))
            < 1e-4
        )


def test_seeded_sampling_reproduces_whatever_the_batch(tiny_llama):
    prompt = random_prompts(1, 12, 12, seed=10)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = LLM(tiny_llama, num_kv_blocks=128).generate([prompt], seeded)[0].token_ids
    crowd = random_prompts(5, 5, 50, seed=11)
    together = LLM(tiny_llama, num_kv_blocks=128).generate(
        crowd[:2] + [prompt] + crowd[2:],
        [SamplingParams(temperature=1.0, max_tokens=30)] * 2
        + [seeded]
        + [SamplingParams(temperature=1.0, max_tokens=30)] * 3,
    )
    assert together[2].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24, ignore_eos=True)
    assert LLM(tiny_llama, num_kv_blocks=128).generate([prompt], other_seed)[0].token_ids != alone


def test_n_completions_are_returned_together(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=128)
    (out,) = llm.generate(
        ["hello there"], SamplingParams(n=3, seed=5, max_tokens=8, ignore_eos=True)
    )
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_pool_whole(llm)


def test_stop_strings_and_stop_tokens_end_the_request(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=128)
    prompt = random_prompts(1, 20, 20, seed=12)[0]
    (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop_token = free.token_ids[5]
    (by_token,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token])
    )
    assert by_token.finish_reason == "stop" and by_token.outputs[0].stop_reason == stop_token
    assert by_token.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]
    stop = free.text[len(free.text) // 2 :][:3]
    (by_string,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
    )
    assert by_string.finish_reason == "stop" and stop not in by_string.text
    assert free.text.startswith(by_string.text)
    assert_pool_whole(llm)

"""Prompt logprobs: each prompt token's logprob, rank and top-k equal transformers' float32
log-softmax over the prompt, whatever the chunking, caching, preemption or slicing."""

import pytest
import torch
from greedy_checks import assert_pool_whole, random_prompts

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.sample import prompt_logprobs
from pagedbatch.engine.sampling_params import RequestOutputKind

TOLERANCE = 1e-4


def assert_scores_prompt(oracle, model_dir, prompt, scored, k):
    """`scored` (an output's prompt_logprobs) is the oracle's log-softmax over `prompt`."""
    assert scored[0] is None and len(scored) == len(prompt)
    expected = oracle.logprobs(model_dir, prompt[:1], prompt[1:])
    for row, entry, token in zip(expected, scored[1:], prompt[1:], strict=True):
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) < TOLERANCE
        # Tokens whose logprobs lie within the tolerance of the token's may rank either side.
        value = row[token].item()
        assert (row > value + TOLERANCE).sum() < entry.rank <= (row > value - TOLERANCE).sum() + 1
        top = torch.topk(row, k)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        values = [v for _, v in entry.top]
        differences = [abs(a - b) for a, b in zip(values, top.values.tolist(), strict=True)]
        assert max(differences, default=0) < TOLERANCE


def test_prompt_logprobs_equal_transformers_log_softmax(tiny_qwen2, oracle):
    prompt = random_prompts(1, 40, 40, seed=21)[0]
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=5)
    (out,) = LLM(tiny_qwen2, num_kv_blocks=64).generate([prompt], params)
    assert_scores_prompt(oracle, tiny_qwen2, prompt, out.prompt_logprobs, 5)


def test_no_prompt_logprobs_unless_asked_and_zero_means_the_token_alone(tiny_llama, oracle):
    prompt = random_prompts(1, 12, 12, seed=22)[0]
    llm = LLM(tiny_llama, num_kv_blocks=64)
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=2))
    assert plain.prompt_logprobs is None
    (bare,) = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert_scores_prompt(oracle, tiny_llama, prompt, bare.prompt_logprobs, 0)
    (one,) = llm.generate([prompt[:1]], SamplingParams(max_tokens=2, prompt_logprobs=3))
    assert one.prompt_logprobs == [None]


def test_across_chunks_cached_prefixes_preemption_and_slices(tiny_llama, oracle, monkeypatch):
    # Rows scored three at a time; prompts prefilled in chunks of up to 16 tokens, sharing a
    # prefix that the prefix cache holds, in a pool small enough that some are preempted.
    monkeypatch.setattr(prompt_logprobs, "SLICE_ROWS", 3)
    shared = random_prompts(1, 48, 48, seed=23)[0]
    prompts = [shared + tail for tail in random_prompts(6, 5, 30, seed=24)]
    llm = LLM(tiny_llama, num_kv_blocks=14, block_size=16, max_num_batched_tokens=16)
    llm.generate([shared], SamplingParams(max_tokens=1))  # the prefix now cached
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=4, n=2)
    outputs = llm.generate(prompts, params)
    assert llm.get_stats()["preemptions"] > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_scores_prompt(oracle, tiny_llama, prompt, out.prompt_logprobs, 4)
    assert_pool_whole(llm)


def test_a_stream_carries_the_prompt_logprobs_once(tiny_llama):
    engine = LLM(tiny_llama, num_kv_blocks=64).engine
    prompt = random_prompts(1, 10, 10, seed=26)[0]
    delta = RequestOutputKind.DELTA
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2, output_kind=delta)
    engine.add_request("stream", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    carrying = [output for output in outputs if output.prompt_logprobs is not None]
    assert len(outputs) > 1 and len(carrying) == 1
    assert len(carrying[0].prompt_logprobs) == len(prompt)


@pytest.mark.parametrize("k", [-1, 21, True])
def test_k_is_bounded(k):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=k)


@pytest.mark.parametrize(
    "overrides",
    # An odd vocabulary under tied embeddings: each rank's LM head is a padded slice.
    [{}, {"vocab_size": 16385, "tie_word_embeddings": True}],
    ids=["llama", "llama-odd-vocab-tied"],
)
def test_two_ranks_score_the_prompt_as_one(make_checkpoint, overrides):
    model_dir = make_checkpoint("llama", **overrides)
    prompt = random_prompts(1, 30, 30, seed=25)[0]
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    args = {"num_kv_blocks": 64, "max_num_batched_tokens": 16}
    (one,) = LLM(model_dir, **args).generate([prompt], params)
    llm = LLM(model_dir, tensor_parallel_size=2, **args)
    try:
        (two,) = llm.generate([prompt], params)
    finally:
        llm.shutdown()
    assert two.prompt_logprobs[0] is None and len(two.prompt_logprobs) == len(prompt)
    for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOLERANCE
        assert [t for t, _ in a.top] == [t for t, _ in b.top]

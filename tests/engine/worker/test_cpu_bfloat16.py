"""`dtype bfloat16` on the CPU: where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX),
the engine runs in it end to end and its log-probabilities stay within bfloat16's rounding of
float32's; where it does not, the engine refuses at start, before loading anything."""

from __future__ import annotations

import pytest
import torch
from native_bf16 import needs_native_bf16

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.kernels import native

# Half a bfloat16 ulp, relative: one rounding's worst error.
BF16_ROUNDING = 2.0**-9
PROMPTS = [[1, *range(5 + i, 60 + 7 * i, 1 + i % 3)] for i in range(6)]
DECODED = 8


def run(path, dtype: str) -> tuple[list[list[float]], list[list[int]], list[list[float]]]:
    """Each prompt's tokens' log-probabilities, its greedy tokens and theirs."""
    llm = LLM(path, dtype=dtype, device="cpu", num_kv_blocks=256)
    try:
        assert llm.engine.runner.dtype == torch.__dict__[dtype]
        assert llm.engine.runner.kv_cache_dtype == torch.__dict__[dtype]
        params = SamplingParams(
            temperature=0, max_tokens=DECODED, prompt_logprobs=0, logprobs=0, ignore_eos=True
        )
        outputs = llm.generate(PROMPTS, params)
    finally:
        llm.shutdown()
    return (
        [[e.logprob for e in o.prompt_logprobs[1:]] for o in outputs],
        [list(o.outputs[0].token_ids) for o in outputs],
        [[e.logprob for e in o.outputs[0].logprobs] for o in outputs],
    )


@needs_native_bf16
def test_bfloat16_logprobs_stay_within_its_rounding_of_float32s(tiny_llama):
    exact_prompt, exact_tokens, exact_decoded = run(tiny_llama, "float32")
    half_prompt, half_tokens, half_decoded = run(tiny_llama, "bfloat16")
    # First order, each rounding to bfloat16 adds at most BF16_ROUNDING of the value it rounds,
    # and errors add up along the residual stream: per layer its input's rounding, the two
    # products written back into it (their weights rounded too) and the two residual sums; the
    # LM head's weights and output once more. Measured on tiny (4 layers): 0.37 of logprobs
    # around -22, about a third of this bound.
    layers = 4
    roundings = 7 * layers + 2
    bounds = []
    for exact, half in zip(exact_prompt, half_prompt, strict=True):
        bounds.append(roundings * BF16_ROUNDING * max(abs(x) for x in exact))
        worst = max(abs(a - b) for a, b in zip(exact, half, strict=True))
        assert worst <= bounds[-1], (worst, bounds[-1])
        assert worst > 0  # bfloat16 ran: float32's arithmetic would give the same figures
    # Decode steps (the attention over cached keys and values): the greedy tokens' own
    # log-probabilities, as long as the two runs chose the same tokens.
    compared = 0
    for bound, *runs in zip(
        bounds, exact_tokens, half_tokens, exact_decoded, half_decoded, strict=True
    ):
        for a_token, b_token, a, b in zip(*runs, strict=True):
            if a_token != b_token:
                break
            assert abs(a - b) <= bound, (a, b, bound)
            compared += 1
    assert compared >= len(PROMPTS) * DECODED // 2


def test_bfloat16_is_refused_at_start_on_a_cpu_without_native_bfloat16(tiny_llama, monkeypatch):
    # An AVX512 Skylake's flags: no avx512_bf16, no amx_bf16.
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "fma"}))
    with pytest.raises(ValueError, match="dtype bfloat16 on CPU needs native bfloat16"):
        LLM(tiny_llama, dtype="bfloat16", device="cpu", num_kv_blocks=256)
    # float32 runs there as before.
    llm = LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=256)
    try:
        (output,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=2))
        assert len(output.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()

"""`kv_cache_dtype` int8 and fp8: the engine stores K and V one byte an element with a scale per
32 elements of a token's KV head (kernels/kv_quant.py), fits more blocks in the same memory,
reports the dtype, and scores text close to the unquantized cache's (not identically: see the
kernel tests for the bounds), through prefill chunks that read earlier chunks' keys and through
decode. float16 under a float32 model: two bytes an element, each rounded once as it is cached."""

from __future__ import annotations

import pytest
import torch
from greedy_checks import random_prompts

from pagedbatch.api.routes.engine import settings_in_force
from pagedbatch.engine import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedbatch.kernels import kv_quant, ops
from pagedbatch.kernels.kv_quant import QUANTIZED, QuantizedCache

# Logprobs of the quantized engine against the float engine whose K and V are rounded to the
# format's values before they are cached, in a one-layer model: the same numbers but for float32
# rounding (the kernels scale scores where the reference scales elements).
TOLERANCE = 1e-3
# From the second layer on, and in decode, the K and V being cached are not the same numbers in
# the two engines: a layer's input carries the earlier attention's float32 rounding, and decode
# computes a token's K and V in another order than prefill. An element within that rounding of a
# boundary of the format lands on the other side in one engine: a step of its group's scale. The
# tiny random models' logits are steep (a token's logprob about -22), so one such step moves a
# logprob by up to ~0.01 (measured: 0.0074 in decode with int8; 0.0035 in prefill with fp8 on
# Gemma 3's, where torch runs its AVX2 kernels); a cache read wrongly moves it by nats.
STEP_TOLERANCE = 0.05
# One layer, of the kind whose window the prompts pass (Gemma's first layer is a sliding one).
ONE_LAYER = {
    "llama": {"num_hidden_layers": 1},
    "gemma2": {"num_hidden_layers": 1, "layer_types": ["sliding_attention"]},
    "gemma3": {"num_hidden_layers": 1, "layer_types": ["sliding_attention"]},
}
GIB = 2**30


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices():
    choices = "auto, float32, float16, bfloat16, fp8, int8"
    with pytest.raises(ValueError, match=f"kv_cache_dtype.*{choices}"):
        EngineArgs(model="x", kv_cache_dtype="fp16")


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_the_same_memory_holds_more_blocks_and_the_stats_say_the_dtype(tiny_llama, kv):
    budget = 0.01  # GiB
    plain = LLMEngine(EngineArgs(model=str(tiny_llama), kv_cache_memory_gib=budget))
    quant = LLMEngine(
        EngineArgs(model=str(tiny_llama), kv_cache_memory_gib=budget, kv_cache_dtype=kv)
    )
    head_dim = plain.model_config.head_dim
    # float32 rows of head_dim * 4 bytes against head_dim bytes plus a 4-byte scale a group
    scales = kv_quant.scales_per_row(head_dim)
    ratio = quant.runner.num_blocks / plain.runner.num_blocks
    assert ratio == pytest.approx(4 * head_dim / (head_dim + 4 * scales), rel=0.01)
    key_cache, value_cache = quant.runner.kv_caches[0]
    assert isinstance(key_cache, QuantizedCache) and isinstance(value_cache, QuantizedCache)
    assert key_cache.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    # The resident bytes are the budget's, scales included.
    runner = quant.runner
    assert quant.resident.kv_cache_bytes == runner.num_blocks * runner.kv_bytes_per_block
    assert quant.resident.kv_cache_bytes <= budget * GIB
    assert settings_in_force(quant)["kv_cache_dtype"] == kv
    assert settings_in_force(plain)["kv_cache_dtype"] == "float32"


def test_auto_is_the_activations_dtype_but_float16_for_float32_on_quantized_weights():
    """As llama.cpp's cache, and as a GGUF's in vLLM, whose activations are 16-bit."""
    for activations in (torch.float32, torch.bfloat16, torch.float16):
        assert kv_quant.storage_dtype("auto", activations) == activations
    assert kv_quant.storage_dtype("auto", torch.float32, quantized_weights=True) == torch.float16
    assert kv_quant.storage_dtype("auto", torch.bfloat16, quantized_weights=True) == torch.bfloat16
    for name in ("float32", "bfloat16"):  # asked for: as asked
        stored = kv_quant.storage_dtype(name, torch.float32, quantized_weights=True)
        assert stored == getattr(torch, name)


def test_a_float16_cache_holds_twice_a_float32_ones_blocks(tiny_llama):
    budget = 0.01  # GiB
    plain = LLMEngine(EngineArgs(model=str(tiny_llama), kv_cache_memory_gib=budget))
    half = LLMEngine(
        EngineArgs(model=str(tiny_llama), kv_cache_memory_gib=budget, kv_cache_dtype="float16")
    )
    assert half.runner.num_blocks / plain.runner.num_blocks == pytest.approx(2, rel=0.01)
    key_cache, value_cache = half.runner.kv_caches[0]
    assert key_cache.dtype == value_cache.dtype == torch.float16
    assert half.runner.dtype == torch.float32  # the activations stay the model's
    assert settings_in_force(half)["kv_cache_dtype"] == "float16"


def scored(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    return [[e.logprob for e in o.prompt_logprobs[1:]] for o in llm.generate(prompts, params)]


@pytest.fixture
def rounded_reference(monkeypatch):
    """`make(kv)`: makes the next engines' float caches hold K and V rounded through the format
    (quantized and dequantized as they are written): what a quantized cache holds, in float32."""

    def make(kv: str) -> None:
        write = ops.TORCH.reshape_and_cache

        def through(x: torch.Tensor) -> torch.Tensor:
            if kv in kv_quant.FLOATS:
                return x.to(kv_quant.FLOATS[kv]).to(x.dtype)
            return kv_quant.dequantize(*kv_quant.quantize(x, QUANTIZED[kv]), x.dtype)

        def rounded(key, value, key_cache, value_cache, slots):
            write(through(key), through(value), key_cache, value_cache, slots)

        monkeypatch.setattr(ops, "TORCH", ops.TORCH._replace(reshape_and_cache=rounded))
        ops.reset()

    yield make
    ops.reset()


@pytest.mark.parametrize("kv", ["int8", "fp8", "float16"])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
@pytest.mark.parametrize("layers", ["one", "all"])
def test_prefill_chunks_and_decode_read_what_was_stored(
    make_checkpoint, rounded_reference, arch, layers, kv
):
    model_dir = make_checkpoint(arch, **(ONE_LAYER[arch] if layers == "one" else {}))
    prefill_tolerance = TOLERANCE if layers == "one" else STEP_TOLERANCE
    # Prompts prefilled 16 tokens a step: each chunk reads the earlier ones' keys from the cache.
    args = dict(num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)
    prompts = random_prompts(3, 30, 60, seed=31)
    quant = LLM(model_dir, kv_cache_dtype=kv, **args)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    decoded = [o.outputs[0] for o in quant.generate(prompts, greedy)]
    full = [p + list(c.token_ids) for p, c in zip(prompts, decoded, strict=True)]
    quant_scores = scored(quant, full)
    rounded_reference(kv)
    reference = LLM(model_dir, **args)
    assert reference.engine.runner.kv_cache_dtype == torch.float32
    for prompt, completion, got, expected in zip(
        prompts, decoded, quant_scores, scored(reference, full), strict=True
    ):
        # Prefill, in chunks: every token of prompt and completion scored.
        assert max(abs(x - y) for x, y in zip(got, expected, strict=True)) < prefill_tolerance
        # Decode: the logprobs of the tokens as the quantized engine decoded them.
        decoded_scores = [e.logprob for e in completion.logprobs]
        tail = expected[len(prompt) - 1 :]
        error = max(abs(x - y) for x, y in zip(decoded_scores, tail, strict=True))
        assert error < STEP_TOLERANCE


@pytest.mark.real_model
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantization_gguf_decodes_unfused_over_a_quantized_cache(real_model, kv):
    # decode_layer.c reads a float32 cache only: under int8/fp8 its fused layers are not built
    # and decode steps take the layers' torch path, whose attention reads the quantized cache.
    llm = LLM(real_model("smollm2-135m-instruct"), num_kv_blocks=64, kv_cache_dtype=kv)
    assert llm.engine.runner.quantization == "gguf"
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out.outputs[0].text
    model = llm.engine.runner.model
    assert model._decode_layers is not None and model._decode_layers[1] == []

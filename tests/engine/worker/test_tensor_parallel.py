"""Tensor parallelism on CPU (gloo): the model split across ranks gives the tokens it gives whole,
each rank loads only its slices, shapes that do not split are refused, and a rank that dies stops
the engine at once instead of hanging it."""

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from audio_oracle import RATE, tone
from safetensors.torch import load_file
from transformers import AutoTokenizer
from vision_oracle import image

from pagedbatch.cli import build_parser, settings_from_args
from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.distributed import TensorParallel, building_for
from pagedbatch.engine.worker.loader import iterate_weights
from pagedbatch.engine.worker.models.llama import LlamaForCausalLM
from pagedbatch.engine.worker.ranks import TensorParallelError
from pagedbatch.service import start_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Mixed lengths; the longest is prefilled in chunks under the engines' token budget.
PROMPTS = [list(range(100, 140)), list(range(7, 12)), list(range(300, 390))]
ENGINE_ARGS = {"num_kv_blocks": 64, "max_num_batched_tokens": 64}
# An odd vocabulary (padded to split) under tied embeddings: the LM head is the split embedding.
ODD_TIED = {"vocab_size": 16385, "tie_word_embeddings": True}


def rank_processes() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedbatch-rank")]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("qwen2", {}), ("mistral", {}), ("llama", ODD_TIED)],
    ids=["llama", "qwen2", "mistral", "llama-odd-vocab-tied"],
)
def test_two_ranks_give_the_tokens_of_one(make_checkpoint, arch, overrides):
    # The tiny models have 4 attention heads and 2 key/value heads (GQA): one KV head per rank.
    model_dir = make_checkpoint(arch, **overrides)
    expected = [o.token_ids for o in LLM(model_dir, **ENGINE_ARGS).generate(PROMPTS, GREEDY)]
    llm = LLM(model_dir, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        assert llm.engine.runner.kv_caches[0][0].shape[2] == 1  # this rank's KV heads only
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    finally:
        llm.shutdown()
    assert rank_processes() == []


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "qwen2_audio"])
def test_two_ranks_read_media_as_one(make_checkpoint, arch):
    """Every rank encodes the step's images or clips itself (the encoders are whole on each);
    what they read travels with the step."""
    model_dir = make_checkpoint(arch)
    kind = "audio" if arch == "qwen2_audio" else "image"
    template = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": "Hi?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    if kind == "audio":
        prompts = [
            {"prompt": template, "audio": [(tone(300 * seed, 0.7), RATE)]} for seed in (1, 2)
        ]
    else:
        prompts = [{"prompt": template, "images": [image(seed, 60, 90)]} for seed in (1, 2)]
    expected = [o.token_ids for o in LLM(model_dir, **ENGINE_ARGS).generate(prompts, GREEDY)]
    llm = LLM(model_dir, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    finally:
        llm.shutdown()
    assert rank_processes() == []


def shard(model_dir, rank: int, size: int) -> LlamaForCausalLM:
    """Rank `rank`'s model, loaded; it never communicates, so it needs no group."""
    with building_for(TensorParallel(rank, size)):
        model = LlamaForCausalLM(ModelConfig.load(model_dir))
    model.load_weights(iterate_weights(model_dir))
    return model


def test_each_rank_loads_its_slices_and_together_they_are_the_checkpoint(make_checkpoint):
    model_dir = make_checkpoint("llama", **ODD_TIED)
    full = load_file(model_dir / "model.safetensors")
    ranks = [shard(model_dir, rank, 2) for rank in range(2)]

    def joined(param: str, dim: int) -> torch.Tensor:
        return torch.cat([dict(r.named_parameters())[param].detach() for r in ranks], dim=dim)

    layer = "model.layers.1."
    q, k, v = (full[f"{layer}self_attn.{n}_proj.weight"] for n in "qkv")
    # Fused q/k/v: each rank holds its 2 query heads and its 1 key/value head.
    per_rank = [r.layers[1].self_attn.qkv_proj.weight.detach() for r in ranks]
    for rank, weight in enumerate(per_rank):
        rq, rk, rv = weight.split([64, 32, 32])
        assert torch.equal(rq, q[rank * 64 : (rank + 1) * 64])
        assert torch.equal(rk, k[rank * 32 : (rank + 1) * 32])
        assert torch.equal(rv, v[rank * 32 : (rank + 1) * 32])
    # Row-parallel: input features split.
    assert torch.equal(
        joined("layers.1.self_attn.o_proj.weight", 1), full[f"{layer}self_attn.o_proj.weight"]
    )
    assert torch.equal(
        joined("layers.1.mlp.down_proj.weight", 1), full[f"{layer}mlp.down_proj.weight"]
    )
    gate, up = full[f"{layer}mlp.gate_proj.weight"], full[f"{layer}mlp.up_proj.weight"]
    for rank, r in enumerate(ranks):
        assert torch.equal(
            r.layers[1].mlp.gate_up_proj.weight.detach(),
            torch.cat([gate[rank * 192 : (rank + 1) * 192], up[rank * 192 : (rank + 1) * 192]]),
        )
    # The vocabulary: 8193 rows each, the last rank's final row padding.
    embed = joined("embed_tokens.weight", 0)
    assert embed.shape[0] == 16386
    assert torch.equal(embed[:16385], full["model.embed_tokens.weight"])
    assert not embed[16385].any()
    assert all(r.lm_head.weight is r.embed_tokens.weight for r in ranks)
    # What every rank needs whole, every rank holds whole.
    for r in ranks:
        assert torch.equal(
            r.layers[1].input_layernorm.weight.detach(), full[f"{layer}input_layernorm.weight"]
        )


def test_checkpoint_tensors_read_only_the_slice_asked_for(tiny_llama):
    full = load_file(tiny_llama / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensor = dict(iterate_weights(tiny_llama))[name]
    assert tensor.shape == full[name].shape
    assert torch.equal(tensor[3:7], full[name][3:7])
    assert torch.equal(tensor[:, 64:128], full[name][:, 64:128])


@pytest.mark.parametrize(
    ("overrides", "size", "message"),
    [
        ({}, 3, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"),
        (
            {"num_key_value_heads": 1},
            2,
            r"num_key_value_heads \(1\) is not divisible by tensor_parallel_size \(2\)",
        ),
    ],
    ids=["attention-heads", "kv-heads"],
)
def test_heads_that_do_not_split_are_refused_before_any_rank_starts(
    make_checkpoint, overrides, size, message
):
    with pytest.raises(ValueError, match=message):
        LLM(make_checkpoint("llama", **overrides), tensor_parallel_size=size, num_kv_blocks=8)
    assert rank_processes() == []


def test_the_worker_setting_reaches_the_engine(tiny_llama):
    args = build_parser().parse_args(["worker", "--tensor-parallel-size", "3"])
    settings = settings_from_args(args).model_copy(update={"model": str(tiny_llama)})
    assert settings.tensor_parallel_size == 3
    with pytest.raises(ValueError, match="tensor_parallel_size \\(3\\)"):
        start_engine(settings)


def test_a_killed_rank_fails_the_engine_within_seconds_and_frees_the_others(make_checkpoint):
    # Three ranks: kill rank 1 while the engine runs; rank 0 must raise and rank 2 must go.
    model_dir = make_checkpoint(
        "llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16
    )
    llm = LLM(model_dir, tensor_parallel_size=3, num_kv_blocks=64)
    rank1, rank2 = llm.engine.runner.ranks.pids
    failure: list[BaseException] = []
    failed_at: list[float] = []

    def generate() -> None:
        try:
            llm.generate(PROMPTS, SamplingParams(max_tokens=900, ignore_eos=True))
        except BaseException as e:  # noqa: BLE001 - what the test looks at
            failure.append(e)
            failed_at.append(time.monotonic())

    runner = threading.Thread(target=generate)
    runner.start()
    deadline = time.monotonic() + 30
    while len(llm.engine.scheduler.running) < len(PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed_at = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    runner.join(timeout=30)
    assert not runner.is_alive()
    (error,) = failure
    assert isinstance(error, TensorParallelError)
    assert "rank 1 died" in str(error) and "SIGKILL" in str(error)
    assert failed_at[0] - killed_at < 5
    assert rank_processes() == []
    for pid in (rank1, rank2):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(TensorParallelError, match="rank 1 died"):
        llm.generate(PROMPTS, GREEDY)

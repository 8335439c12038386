"""A prefill's MLP runs over its tokens in chunks on the CPU (llama.MLP_CHUNK_ROWS), so that its
widest intermediates are a chunk's size: with exactly the values it computes for all rows at once,
on every CPU path a linear takes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pagedbatch.engine.worker.models.llama import MLP, MLP_CHUNK_ROWS, in_row_chunks
from pagedbatch.engine.worker.parallel_layers import (
    bfloat16_weights,
    pack_weights,
    quantize_linears,
)
from pagedbatch.kernels.quant_blocks import Format
from pagedbatch.kernels.quant_linear import QuantizedTensor, small_batch

HIDDEN, INTERMEDIATE = 64, 96
ROWS = 2 * MLP_CHUNK_ROWS + 6  # three chunks; all at once, no chunk of a few rows


def test_chunks_are_near_equal_and_none_is_a_few_rows():
    seen: list[int] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return x * 2

    x = torch.arange(1030.0).unsqueeze(1)
    assert torch.equal(in_row_chunks(record, x, 512), x * 2)
    assert seen == [343, 343, 344]
    seen.clear()
    in_row_chunks(record, x[: 512 + small_batch() // 2], 512)
    assert min(seen) > small_batch()
    seen.clear()
    in_row_chunks(record, x[:512], 512)
    assert seen == [512]


def q4_1(weights: np.ndarray) -> QuantizedTensor:
    blocks = quantize(weights.astype(np.float32), GGMLQuantizationType.Q4_1)
    return QuantizedTensor(torch.from_numpy(blocks), Format.Q4_1, weights.shape[1])


def mlp(weights: str) -> MLP:
    """An MLP of random weights: float32, oneDNN-packed, bfloat16 or GGUF Q4_1 blocks."""
    cfg = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE)
    module = MLP(cfg)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    gate, up = (rng.standard_normal((INTERMEDIATE, HIDDEN)) / 8 for _ in range(2))
    down = rng.standard_normal((HIDDEN, INTERMEDIATE)) / 8
    if weights == "q4_1":
        for index, part in enumerate((gate, up)):
            module.gate_up_proj.weight_loader(module.gate_up_proj.weight, q4_1(part), index)
        module.down_proj.weight_loader(module.down_proj.weight, q4_1(down))
        assert quantize_linears(torch.nn.ModuleList([module]))[0] == 2
        return module
    with torch.no_grad():
        module.gate_up_proj.weight.copy_(torch.from_numpy(np.concatenate([gate, up])))
        module.down_proj.weight.copy_(torch.from_numpy(down))
    if weights == "packed":
        pack_weights(module, ROWS)
    elif weights == "bfloat16":
        bfloat16_weights(module)
    return module


@pytest.mark.parametrize(
    ("weights", "gemm"),
    [
        ("float32", None),
        ("packed", None),
        ("q4_1", "auto"),  # quant_gemm.c where the CPU has AMX, else the float32 tiles
        ("q4_1", "float32"),  # the tiles: dequantized, torch's float32 GEMM
    ],
)
@torch.inference_mode()
def test_chunked_rows_equal_all_rows_at_once(
    weights: str, gemm: str | None, monkeypatch: pytest.MonkeyPatch
):
    if gemm is not None:
        monkeypatch.setenv("PAGEDBATCH_QUANT_GEMM", gemm)
    module = mlp(weights)
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert module.chunkable(x)
    assert torch.equal(module(x), module.rows(x))


def test_bfloat16_and_lora_run_all_rows_at_once():
    """oneDNN's bfloat16 products of 2,048 rows part from 4 chunks' by up to 0.5 (SmolLM2's
    shapes), and adapters' deltas follow the step's rows: neither is chunked."""
    x = torch.randn(ROWS, HIDDEN)
    assert not mlp("bfloat16").chunkable(x)
    assert not mlp("float32").chunkable(x.bfloat16())
    adapted = mlp("float32")
    adapted.down_proj.lora = object()  # type: ignore[assignment]
    assert not adapted.chunkable(x)

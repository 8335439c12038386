"""The model's resident size (engine/worker/resident.py): its float weights, its quantized blocks
and its KV cache, each storage counted once, reported at start and in get_stats()."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from pagedbatch.engine import LLM
from pagedbatch.engine.worker.resident import ResidentSize
from pagedbatch.kernels.quant_blocks import Format
from pagedbatch.kernels.quant_linear import QuantizedTensor, QuantizedWeight


def checkpoint_bytes(model_dir: Path) -> int:
    files = model_dir.glob("*.safetensors")
    return sum(t.numel() * 4 for file in files for t in load_file(file).values())  # float32


def test_a_float_model_reports_its_weights_and_kv_cache(tiny_llama: Path, caplog):
    with caplog.at_level(logging.INFO, logger="pagedbatch.engine.llm_engine"):
        llm = LLM(tiny_llama, num_kv_blocks=16)
    engine = llm.engine
    resident = engine.resident
    assert resident.kv_cache_bytes == 16 * engine.runner.kv_bytes_per_block
    assert resident.quantized_bytes == 0
    # The checkpoint's weights once (packed copies replace the linears' own) but the LM head's,
    # which keeps its weight beside its packed copy, plus small buffers such as RoPE's tables.
    head = engine.runner.model.lm_head.weight
    weights = checkpoint_bytes(tiny_llama) + head.numel() * head.element_size()
    assert weights <= resident.weights_bytes <= 1.1 * weights
    assert engine.get_stats()["resident"] == {
        "weights_bytes": resident.weights_bytes,
        "quantized_bytes": 0,
        "kv_cache_bytes": resident.kv_cache_bytes,
    }
    assert f"resident: {resident.describe()}" in caplog.text


def test_shared_blocks_are_counted_once_and_float_copies_apart():
    blocks = torch.zeros(8, Format.Q8_0.row_bytes(64), dtype=torch.uint8)
    embedding, head, linear = torch.nn.Module(), torch.nn.Module(), torch.nn.Linear(4, 4)
    embedding.quantized = QuantizedTensor(blocks, Format.Q8_0, 64)
    head.packed = QuantizedWeight([(blocks, Format.Q8_0)], 64)  # a tied head: the same blocks
    model = torch.nn.ModuleList([embedding, head, linear])
    cache = [(torch.zeros(2, 3), torch.zeros(2, 3))]
    assert ResidentSize.of(model, cache) == ResidentSize(
        weights_bytes=(16 + 4) * 4, quantized_bytes=blocks.numel(), kv_cache_bytes=2 * 6 * 4
    )

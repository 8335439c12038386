"""On CPU in float32 the linears run on weights packed once into oneDNN's layout: the same
products as F.linear to rounding, for any number of rows, and the model holds each weight once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedbatch.engine import LLM
from pagedbatch.engine.worker.parallel_layers import (
    ColumnParallelLinear,
    Packed,
    ParallelLMHead,
    RowParallelLinear,
)

LINEARS = ColumnParallelLinear | RowParallelLinear


@pytest.mark.parametrize("rows", [1, 7, 128, 300])
def test_a_packed_weight_gives_f_linears_products(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(384, 128, generator=generator) / 12
    bias = torch.randn(384, generator=generator)
    x = torch.randn(rows, 128, generator=generator)
    packed = Packed(weight, rows=128)
    torch.testing.assert_close(packed(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_float32_cpu_model_packs_every_linear_and_keeps_each_weight_once(tiny_llama):
    model = LLM(tiny_llama, num_kv_blocks=16).engine.runner.model
    linears = [
        m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    head = next(m for m in model.modules() if isinstance(m, ParallelLMHead))
    assert head.packed is not None and head.weight.numel() > 0


def test_other_dtypes_keep_f_linear(tiny_llama):
    model = LLM(tiny_llama, num_kv_blocks=16, dtype="bfloat16").engine.runner.model
    linears = [
        m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    assert all(m.packed is None and m.weight.numel() > 0 for m in linears)

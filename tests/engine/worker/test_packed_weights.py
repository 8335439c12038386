"""On CPU in float32 the linears run on weights packed once into oneDNN's layout: the same
products as F.linear to rounding, for any number of rows, and the model holds each weight once.
With `matmul_precision` bfloat16 (an embedding model's choice on CPUs with AMX) they run on
weights held in bfloat16, within bfloat16's rounding of the float32 products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from native_bf16 import needs_native_bf16

from pagedbatch.engine import LLM
from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.model_runner import resolve_matmul_precision
from pagedbatch.engine.worker.parallel_layers import (
    Bfloat16Weight,
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


@needs_native_bf16
def test_other_dtypes_keep_f_linear(tiny_llama):
    model = LLM(tiny_llama, num_kv_blocks=16, dtype="bfloat16").engine.runner.model
    linears = [
        m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    assert all(m.packed is None and m.weight.numel() > 0 for m in linears)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_a_bfloat16_weight_gives_the_products_of_its_rounded_inputs(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(384, 128, generator=generator) / 12
    bias = torch.randn(384, generator=generator)
    x = torch.randn(rows, 128, generator=generator)
    got = Bfloat16Weight(weight)(x, bias)
    assert got.dtype == torch.float32
    # The products of the bfloat16-rounded operands, summed in float32 and rounded once to
    # bfloat16 (half a unit in its last place, at most 2**-8 of the product) before the bias.
    product = F.linear(x.bfloat16().double(), weight.bfloat16().double())
    error = (got.double() - (product + bias.double())).abs()
    assert (error <= product.abs() * 2**-8 + 1e-5).all()
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert (got.double() - exact).abs().max() > 1e-5  # not float32's products


def test_a_bfloat16_input_stays_bfloat16_for_the_next_matmul():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 128, generator=generator) / 12
    bias = torch.randn(384, generator=generator)
    x = torch.randn(5, 128, generator=generator)
    packed = Bfloat16Weight(weight)
    got = packed(x.bfloat16(), bias)
    assert got.dtype == torch.bfloat16
    # The same products as from float32 input, the bias added before the one rounding.
    torch.testing.assert_close(got.float(), packed(x, bias), rtol=2**-7, atol=1e-2)


def test_a_bfloat16_model_holds_each_linears_weight_once_in_bfloat16(make_checkpoint):
    model = LLM(make_checkpoint("bert"), matmul_precision="bfloat16").engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, LINEARS)]
    assert linears and all(isinstance(m.packed, Bfloat16Weight) for m in linears)
    assert all(m.input_dtype == torch.bfloat16 for m in linears if hasattr(m, "input_dtype"))
    assert all(m.packed.weight.dtype == torch.bfloat16 and m.weight.numel() == 0 for m in linears)


AMX = frozenset({"avx512f", "amx_tile", "amx_bf16"})
AVX2 = frozenset({"avx2", "fma"})


def test_auto_takes_bfloat16_for_embedding_models_on_cpus_that_multiply_it_natively(
    make_checkpoint, tiny_llama
):
    embedder = ModelConfig.load(make_checkpoint("bert"))
    generator = ModelConfig.load(tiny_llama)
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_matmul_precision("auto", embedder, cpu, f32, AMX) == "bfloat16"
    assert resolve_matmul_precision("auto", embedder, cpu, f32, {"avx512_bf16"}) == "bfloat16"
    assert resolve_matmul_precision("auto", embedder, cpu, f32, AVX2) == "highest"
    # Generated text stays token-identical to float32 references unless asked otherwise.
    assert resolve_matmul_precision("auto", generator, cpu, f32, AMX) == "highest"
    assert resolve_matmul_precision("bfloat16", generator, cpu, f32, AVX2) == "bfloat16"
    assert resolve_matmul_precision("highest", embedder, cpu, f32, AMX) == "highest"
    # A model already in half precision, or on a GPU, has its own arithmetic.
    assert resolve_matmul_precision("auto", embedder, cpu, torch.bfloat16, AMX) == "highest"
    with pytest.raises(ValueError, match="float32 models on CPU only"):
        resolve_matmul_precision("bfloat16", embedder, cpu, torch.bfloat16, AMX)

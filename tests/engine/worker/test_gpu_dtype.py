"""The dtype a model runs in when none is asked for (`--dtype auto`): float32 on the CPU, half
precision on a GPU (bfloat16 for a float32 checkpoint, a half-precision checkpoint's own)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.model_runner import resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # a device's name needs no GPU


@pytest.fixture(scope="module")
def config(make_checkpoint) -> ModelConfig:
    return ModelConfig.load(make_checkpoint("llama"))  # a float32 checkpoint


def saved_in(config: ModelConfig, dtype: torch.dtype) -> ModelConfig:
    return dataclasses.replace(config, torch_dtype=dtype)


def test_a_float32_checkpoint_runs_in_bfloat16_on_a_gpu_and_float32_on_the_cpu(config):
    assert config.torch_dtype == torch.float32
    assert resolve_dtype("auto", config, CUDA) == torch.bfloat16
    assert resolve_dtype("auto", config, CPU) == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_half_precision_checkpoint_keeps_its_own_on_a_gpu(config, dtype):
    assert resolve_dtype("auto", saved_in(config, dtype), CUDA) == dtype
    assert resolve_dtype("auto", saved_in(config, dtype), CPU) == torch.float32


@pytest.mark.parametrize("device", [CPU, CUDA], ids=str)
def test_a_dtype_asked_for_wins(config, device):
    assert resolve_dtype("float32", config, device) == torch.float32
    assert resolve_dtype("float16", saved_in(config, torch.bfloat16), device) == torch.float16

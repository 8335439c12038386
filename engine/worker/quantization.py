"""Which weights stay quantized: `quantization` as it applies to a model on a device.

A GGUF's quantized tensors are kept in their blocks (quantization gguf) by default, where the
quantized C kernels run: on the CPU, in float32, on one rank, with float32 matmuls. On one CUDA
device the Triton kernels (`triton_quant`) compute on the blocks in float16, bfloat16 or float32
when quantization gguf is asked for; the default there stays none until they are timed against
the dequantized model's matmuls. Elsewhere, and for a checkpoint without blocks the kernels read
(a safetensors directory, a GGUF of float tensors), the default is none: every weight
dequantized to the model's dtype at load, the exact mode that the transformers-parity tests run
in.
"""

from __future__ import annotations

import importlib.util
import json
import logging

import torch

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker import gguf
from pagedbatch.kernels.quant_blocks import Format

logger = logging.getLogger(__name__)


def resolve_quantization(
    name: str | None,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    ranks: int,
    matmul_precision: str,
) -> str:
    """`quantization` as it applies: `name` where given (gguf refused, with the reason, where
    the kernels cannot run); unset, gguf for a GGUF holding blocks the kernels read, where they
    can run, and none otherwise."""
    if name == "none":
        return "none"
    unfit = _why_not_gguf(cfg, device, dtype, ranks, matmul_precision)
    if name == "gguf":
        if unfit is not None:
            raise ValueError(f"quantization gguf {unfit}")
        return "gguf"
    if not holds_blocks(cfg):
        return "none"
    if unfit is None and device.type == "cuda":
        unfit = "runs on CUDA only when asked for (its Triton kernels are not timed there yet)"
    if unfit is not None:
        logger.info(
            "%s: quantization none, its blocks dequantized at load (quantization gguf %s)",
            cfg.path.name,
            unfit,
        )
        return "none"
    return "gguf"


def holds_blocks(cfg: ModelConfig) -> bool:
    """Whether the checkpoint is a GGUF with a 2-D tensor in a block format the kernels read."""
    if cfg.path.suffix != gguf.SUFFIX or not cfg.path.is_file():
        return False
    entries = json.loads((cfg.metadata_dir / "tensors.json").read_text())
    return any(len(e["shape"]) == 2 and Format.of(e["ggml_type"]) for e in entries)


def _why_not_gguf(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, ranks: int, matmul_precision: str
) -> str | None:
    """Why quantization gguf cannot run here (completing "quantization gguf ..."); None where
    it can. The C kernels are CPU float32 ones, the Triton ones CUDA's, and a rank's slice of
    the blocks is not taken yet."""
    if cfg.path.suffix != gguf.SUFFIX or not cfg.path.is_file():
        return "needs a GGUF model file"
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "on CUDA needs the triton package"
    elif device.type != "cpu" or dtype != torch.float32:
        return "runs on the CPU in float32 or on CUDA only, for now"
    if ranks != 1 or matmul_precision == "bfloat16":
        return "runs on one rank, with matmul_precision highest, for now"
    return None

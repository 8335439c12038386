"""Reading checkpoints straight into the model: safetensors (single file or sharded), or GGUF.

Tensors are handed over unread: a `CheckpointTensor` reads from the file only the part it is
indexed with, so a tensor-parallel rank reads its slices of the weights, not the whole checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagedbatch.engine.worker import gguf
from pagedbatch.kernels.quant_linear import QuantizedTensor


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no .safetensors weights")
    return files


class CheckpointTensor:
    """One tensor of an open safetensors file. Index it to read: `t[:]` reads it whole, `t[a:b]`
    rows a to b, `t[:, a:b]` those columns; nothing else of it is read. Valid while the iteration
    that yielded it is on its file."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]


def iterate_weights(
    model: Path, keep_quantized: bool = False
) -> Iterator[tuple[str, CheckpointTensor | torch.Tensor | QuantizedTensor]]:
    """Yield (name, tensor) one tensor at a time, so a checkpoint never sits in memory twice.
    `model` is a directory of safetensors or a GGUF file (whose tensors come dequantized, or
    with `keep_quantized` those the quantized kernels read as their blocks)."""
    if model.suffix == gguf.SUFFIX and model.is_file():
        yield from gguf.iterate_weights(model, keep_quantized)
        return
    for path in checkpoint_files(model):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, CheckpointTensor(f, name)
        except SafetensorError as e:
            raise ValueError(f"cannot read checkpoint file {path}: {e}") from e

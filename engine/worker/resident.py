"""What a loaded model holds in memory: its float weights, its quantized blocks, its KV cache.

Counted from the tensors themselves, each storage once: a tied LM head's blocks are the
embedding's, and a packed linear's oneDNN copy replaces its emptied weight. The figures are one
rank's (every rank of a tensor-parallel engine holds its own share), and they do not change
while the engine runs: the KV cache is allocated whole at start (on CPU its pages are committed
as blocks are first used, see `kv_cache_memory_gib`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from pagedbatch.kernels.kv_quant import KVCacheTensor, cache_tensors
from pagedbatch.kernels.quant_linear import QuantizedTensor, QuantizedWeight


@dataclass(frozen=True)
class ResidentSize:
    weights_bytes: int  # float parameters and buffers, packed copies included
    quantized_bytes: int  # GGUF blocks the quantized kernels read
    kv_cache_bytes: int

    @classmethod
    def of(
        cls, model: nn.Module, kv_caches: list[tuple[KVCacheTensor, KVCacheTensor]]
    ) -> ResidentSize:
        seen: set[int] = set()
        weights = quantized = 0
        for tensor, is_blocks in _tensors(model):
            key = _storage_key(tensor)
            if key in seen:
                continue
            seen.add(key)
            size = _nbytes(tensor)
            if is_blocks:
                quantized += size
            else:
                weights += size
        kv = sum(_nbytes(t) for pair in kv_caches for c in pair for t in cache_tensors(c))
        return cls(weights_bytes=weights, quantized_bytes=quantized, kv_cache_bytes=kv)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        mib = 2**20
        return (
            f"weights {self.weights_bytes / mib:.1f} MiB, quantized blocks "
            f"{self.quantized_bytes / mib:.1f} MiB, KV cache {self.kv_cache_bytes / mib:.1f} MiB"
        )


def _tensors(model: nn.Module) -> Iterator[tuple[torch.Tensor, bool]]:
    """Every tensor the model holds, and whether it is quantized blocks."""
    for module in model.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            yield tensor, False
        packed = getattr(module, "packed", None)
        if isinstance(packed, QuantizedWeight):
            for blocks, _ in packed.runs:
                yield blocks, True
        elif packed is not None:  # Packed or Bfloat16Weight: a float copy of the weight
            yield packed.weight, False
        kept = getattr(module, "quantized", None)
        if isinstance(kept, QuantizedTensor):
            yield kept.blocks, True


def _storage_key(tensor: torch.Tensor) -> int:
    if tensor.is_mkldnn:  # oneDNN's opaque layout: no storage to share
        return id(tensor)
    return tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)


def _nbytes(tensor: torch.Tensor) -> int:
    if tensor.is_mkldnn or not tensor.numel():
        return tensor.numel() * tensor.element_size()
    return tensor.untyped_storage().nbytes()

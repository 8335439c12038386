"""The kernels the engine calls. Today these are the torch implementations (the CPU path and the
reference); Triton versions with the same signatures will be chosen here by device."""

from pagedbatch.kernels.activation import silu_and_mul
from pagedbatch.kernels.attention import paged_attention, reshape_and_cache
from pagedbatch.kernels.norm import fused_add_rms_norm, rms_norm

__all__ = [
    "fused_add_rms_norm",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "silu_and_mul",
]

"""The kernels the engine calls: the Triton kernels for CUDA tensors, the torch ones elsewhere.

`PAGEDBATCH_KERNELS` overrides the choice: `auto` (the default, as above), `torch` (everywhere) or
`triton` (everywhere). Triton on CPU tensors means Triton's interpreter, for tests: it needs
`TRITON_INTERPRET=1` in the environment before anything in the process imports Triton (Triton's
own library is defined at import, and transformers may import Triton early).

The choice is made once per device kind, on the first call that sees it, and kept: per call, the
cost is one dict lookup. Triton is imported only then, so importing this package needs neither a
GPU nor Triton. `reset` forgets the choices, so that the next call reads the setting again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch

from pagedbatch.kernels import activation, attention, lora, moe, norm, rotary
from pagedbatch.kernels.attention import AttentionMetadata

SETTING = "PAGEDBATCH_KERNELS"
CHOICES = ("auto", "torch", "triton")


class Kernels(NamedTuple):
    """One implementation of every op, each with its torch reference's signature."""

    paged_attention: Callable[..., torch.Tensor]
    reshape_and_cache: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    apply_rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fused_experts: Callable[..., torch.Tensor]
    add_lora: Callable[..., torch.Tensor]


def _kernels(
    attn: ModuleType,
    norms: ModuleType,
    act: ModuleType,
    rope: ModuleType,
    experts: ModuleType,
    loras: ModuleType,
) -> Kernels:
    return Kernels(
        paged_attention=attn.paged_attention,
        reshape_and_cache=attn.reshape_and_cache,
        rms_norm=norms.rms_norm,
        fused_add_rms_norm=norms.fused_add_rms_norm,
        silu_and_mul=act.silu_and_mul,
        apply_rotary_embedding=rope.apply_rotary_embedding,
        fused_experts=experts.fused_experts,
        add_lora=loras.add_lora,
    )


TORCH = _kernels(attention, norm, activation, rotary, moe, lora)

# keyed by Tensor.is_cuda: the one property that decides, and cheap to read
_chosen: dict[bool, Kernels] = {}


def reset() -> None:
    """Forgets the kernels chosen so far: the next call reads `PAGEDBATCH_KERNELS` again."""
    _chosen.clear()


def kernels_for(x: torch.Tensor) -> Kernels:
    """The kernels that run on x's device under the current setting."""
    chosen = _chosen.get(x.is_cuda)
    if chosen is None:
        chosen = _chosen[x.is_cuda] = _choose(x.is_cuda)
    return chosen


def _choose(on_cuda: bool) -> Kernels:
    setting = os.environ.get(SETTING, "auto").strip().lower() or "auto"
    if setting not in CHOICES:
        raise ValueError(f"{SETTING} must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting == "torch" or (setting == "auto" and not on_cuda):
        return TORCH
    try:
        import triton
    except ImportError as e:
        raise RuntimeError(
            f"the Triton kernels need the triton package ({e}); install it, or set {SETTING}=torch"
        ) from e
    if not on_cuda and not triton.knobs.runtime.interpret:
        raise RuntimeError(
            f"{SETTING}={setting} on CPU tensors runs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before the process imports Triton"
        )
    from pagedbatch.kernels import (
        triton_activation,
        triton_attention,
        triton_lora,
        triton_moe,
        triton_norm,
        triton_rotary,
    )

    return _kernels(
        triton_attention, triton_norm, triton_activation, triton_rotary, triton_moe, triton_lora
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    return kernels_for(query).paged_attention(
        query, key_cache, value_cache, meta, scale, sliding_window
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    kernels_for(key).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels_for(x).rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels_for(x).fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return kernels_for(x).silu_and_mul(x)


def apply_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels_for(query).apply_rotary_embedding(positions, query, key, cos_sin_cache)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    return kernels_for(x).fused_experts(x, w13, w2, topk_weights, topk_ids)


def add_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scalings: torch.Tensor,
    gather: torch.Tensor,
    valid: torch.Tensor,
    rows: torch.Tensor,
    width: int,
    subset: torch.Tensor | None,
) -> torch.Tensor:
    return kernels_for(x).add_lora(x, out, a, b, scalings, gather, valid, rows, width, subset)

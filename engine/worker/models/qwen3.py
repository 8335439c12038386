"""Qwen3 (transformers' `Qwen3ForCausalLM`) on the Llama family's parts.

What Qwen3 changes: each head's query and key are normalised over head_dim (q_norm, k_norm,
RMSNorms as Llama's, weights shared by every head) before RoPE; and its q/k/v projections have
no biases, unlike Qwen2's, unless `attention_bias` says so. The rest (sliding windows from
`max_window_layers` on, where `use_sliding_window`) reads as Qwen2's config does.
"""

from __future__ import annotations

import torch

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.models.llama import (
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
)
from pagedbatch.engine.worker.models.rope import RotaryEmbedding
from pagedbatch.kernels.attention import AttentionMetadata


class Qwen3Attention(Attention):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None):
        super().__init__(cfg, rotary, sliding_window)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's query and key normalised over head_dim, then rotated."""
        q, _ = self.q_norm(q)
        k, _ = self.k_norm(k)
        return super().rotate(positions, q, k, meta)


class Qwen3DecoderLayer(DecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer

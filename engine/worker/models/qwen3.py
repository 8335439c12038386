"""Qwen3 (transformers' `Qwen3ForCausalLM`) on the Llama family's parts.

What Qwen3 changes: each head's query and key are normalised over head_dim (q_norm, k_norm,
RMSNorms as Llama's, weights shared by every head) before RoPE; and its q/k/v projections have
no biases, unlike Qwen2's, unless `attention_bias` says so. The rest (sliding windows from
`max_window_layers` on, where `use_sliding_window`) reads as Qwen2's config does.
"""

from __future__ import annotations

from pagedbatch.engine.worker.models.llama import DecoderLayer, LlamaForCausalLM, QKNormAttention


class Qwen3DecoderLayer(DecoderLayer):
    attention_class = QKNormAttention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3DecoderLayer

"""Gemma 3, text only (transformers' `Gemma3ForCausalLM`), on the Llama family's parts.

What Gemma 3 changes, each computed as transformers 5 computes it (float32 results are the same):

- embeddings are multiplied by sqrt(hidden_size), that factor rounded to the weights' dtype;
- every RMSNorm scales by 1 + weight, in float32 (see `GemmaRMSNorm`);
- each layer has four norms: the attention's and the MLP's inputs, as Llama's, and also their
  outputs, before those are added to the residual stream;
- each head's query and key are normalised (q_norm, k_norm) before RoPE, and attention scores
  are scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5;
- layers are sliding-window or full (`layer_types`, or older configs' `sliding_window_pattern`:
  every sixth layer full), each kind with its own RoPE: sliding layers a default one of base
  `rope_local_base_freq`, full layers `rope_theta` with `rope_scaling` (in transformers 5 configs
  both in `rope_parameters`, keyed by layer type);
- the MLP's activation is the tanh approximation of GELU;
- the LM head is the embedding unless the config says otherwise.

Logit soft-capping (Gemma 2's, off in every Gemma 3) and bidirectional attention (Gemma 3's
embedding variants) are refused rather than ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.models.llama import (
    MLP,
    Attention,
    KVCache,
    LlamaForCausalLM,
    QKNormAttention,
    fused_layer,
)
from pagedbatch.engine.worker.models.rope import RotaryEmbedding, rope_parameters
from pagedbatch.engine.worker.parallel_layers import (
    Loaded,
    VocabParallelEmbedding,
    default_weight_loader,
)
from pagedbatch.kernels import ops
from pagedbatch.kernels.attention import AttentionMetadata
from pagedbatch.kernels.decode_layer import DecodeLayer, GemmaNorms

SLIDING = "sliding_attention"
FULL = "full_attention"
# Gemma3TextConfig's defaults, for configs that leave a setting out.
_DEFAULT_ROPE_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
_DEFAULT_SLIDING_WINDOW_PATTERN = 6
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
_ACTIVATION = "gelu_pytorch_tanh"


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by 1 + weight, computed in float32 and rounded once to x's dtype, as
    transformers' Gemma3RMSNorm does (Llama's norm rounds the normalised x before scaling it).

    1 + weight is formed in float32 once, as the weight loads, and kept as `scale`; Llama's norm
    kernel applies it to x upcast to float32. In a float32 model the casts are no-ops and the
    result is bitwise transformers' (its product commutes)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.weight.weight_loader = self._load_weight
        self.eps = eps
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.ones(size), persistent=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual stream); with `residual`, adds it to x first, in x's dtype
        as transformers adds."""
        if residual is not None:
            x = x + residual
        return ops.rms_norm(x.float(), self.scale, self.eps).to(x.dtype), x

    def _load_weight(self, param: nn.Parameter, loaded: Loaded, shard: int | None = None) -> None:
        default_weight_loader(param, loaded)
        # From the weight as cast to the model's dtype, as transformers computes it; after that
        # cast, so the scale stays float32.
        self.scale = param.detach().float() + 1.0


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings times sqrt(hidden_size). The factor is a float32 buffer, so that casting
    the model rounds it to the weights' dtype as transformers' Gemma3TextScaledWordEmbedding
    does (sqrt(3072) is 55.4256 in float32, 55.5 in bfloat16)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.embed_scale: torch.Tensor
        self.register_buffer(
            "embed_scale", torch.tensor(hidden_size**0.5, dtype=torch.float32), persistent=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x is `[..., 2 * d]`, the gate projection then the up projection; returns
    gelu_tanh(gate) * up, as transformers' `gelu_pytorch_tanh` MLP computes it."""
    d = x.shape[-1] // 2
    # In place on gelu's fresh output: the same values, one allocation less.
    return F.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])


class Gemma3Attention(QKNormAttention):
    norm_class = GemmaRMSNorm

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        query_pre_attn_scalar: float,
    ):
        super().__init__(cfg, rotary, sliding_window)
        self.scale = query_pre_attn_scalar**-0.5


class Gemma3MLP(MLP):
    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(gate_up)


class Gemma3DecoderLayer(nn.Module):
    # Built as (cfg, rotary, sliding_window, query_pre_attn_scalar); Gemma 2's has no q/k norms.
    attention_class: type[Attention] = Gemma3Attention

    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        query_pre_attn_scalar: float,
    ):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = self.attention_class(cfg, rotary, sliding_window, query_pre_attn_scalar)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def decode_layer(self, kv_cache: KVCache) -> DecodeLayer | None:
        """This layer as `decode_layer.c` computes it (see llama.fused_layer); None for a
        subclass or parts that change what it computes."""
        attn = self.self_attn
        if not (
            type(self) is Gemma3DecoderLayer
            and type(attn) is Gemma3Attention
            and type(self.mlp) is Gemma3MLP
        ):
            return None
        norms = (self.input_layernorm.scale, self.pre_feedforward_layernorm.scale)
        gemma = GemmaNorms(
            attn.q_norm.scale,
            attn.k_norm.scale,
            self.post_attention_layernorm.scale,
            self.post_feedforward_layernorm.scale,
        )
        eps = self.input_layernorm.eps
        return fused_layer(attn, self.mlp, norms, eps, kv_cache, gemma)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As in Llama's layer, the residual stream is x + residual, the add deferred to the next
        norm that reads the stream (this layer's pre-feedforward norm, the next layer's input
        norm, the final norm). Gemma's output norms apply to x before that add."""
        x, residual = self.input_layernorm(x, residual)
        x, _ = self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x, _ = self.post_feedforward_layernorm(self.mlp(x))
        return x, residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    embedding_class = ScaledEmbedding
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig):
        _check_supported(cfg.raw)
        super().__init__(_gemma3_model_config(cfg))

    def decoder_layers(self, cfg: ModelConfig) -> list[nn.Module]:
        # The engine refuses contexts longer than max_position_embeddings, which for Gemma 3 is
        # already the scaled length (131,072 under a linear factor of 8): the tables stop there.
        max_pos = cfg.max_position_embeddings
        rotaries = {
            kind: RotaryEmbedding(cfg.head_dim, max_pos, params, max_positions=max_pos)
            for kind, params in rope_parameters_by_layer_type(cfg.raw).items()
        }
        scalar = cfg.raw.get("query_pre_attn_scalar", _DEFAULT_QUERY_PRE_ATTN_SCALAR)
        return [
            Gemma3DecoderLayer(cfg, rotaries[kind], window, scalar)
            for kind, window in zip(layer_types(cfg.raw), cfg.sliding_windows, strict=True)
        ]


def layer_types(raw: dict[str, Any]) -> list[str]:
    """Each layer's kind, as Gemma3TextConfig derives it: `layer_types`, or else every
    `sliding_window_pattern`-th layer full and the others sliding."""
    num_layers = raw["num_hidden_layers"]
    kinds = raw.get("layer_types")
    if not kinds:
        pattern = raw.get("sliding_window_pattern", _DEFAULT_SLIDING_WINDOW_PATTERN)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(kinds) != num_layers or not set(kinds) <= {SLIDING, FULL}:
        raise ValueError(
            f"layer_types must name {SLIDING!r} or {FULL!r} for each of the {num_layers} layers, "
            f"got {kinds!r}"
        )
    return list(kinds)


def rope_parameters_by_layer_type(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each layer kind's RoPE settings (as `rope.rope_parameters` returns them), read as
    Gemma3TextConfig reads them: transformers 5's `rope_parameters` keyed by layer kind, with
    `rope_scaling` (older configs' way) applied to full layers, and `rope_theta` and
    `rope_local_base_freq` as the full and sliding layers' bases where those leave them out."""
    nested = raw.get("rope_parameters") or {}
    full = dict(nested.get(FULL) or {}) | (raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA[FULL]))
    sliding = dict(nested.get(SLIDING) or {})
    sliding.setdefault("rope_theta", raw.get("rope_local_base_freq", _DEFAULT_ROPE_THETA[SLIDING]))
    max_positions = raw["max_position_embeddings"]
    return {
        kind: rope_parameters({"rope_parameters": params, "max_position_embeddings": max_positions})
        for kind, params in ((FULL, full), (SLIDING, sliding))
    }


def _check_supported(raw: dict[str, Any]) -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise ValueError(f"Gemma 3 with {key}={raw[key]!r} is not supported (only null)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")
    activation = raw.get("hidden_activation", _ACTIVATION)
    if activation != _ACTIVATION:
        raise ValueError(
            f"Gemma 3 with hidden_activation={activation!r} is not supported (only {_ACTIVATION})"
        )


def _gemma3_model_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with what Gemma 3 reads differently from the Llama family: its sliding layers (older
    configs give a pattern, not `layer_types`) and tied embeddings (by default)."""
    window = cfg.raw.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
    return dataclasses.replace(
        cfg,
        sliding_windows=[window if kind == SLIDING else None for kind in layer_types(cfg.raw)],
        tie_word_embeddings=cfg.raw.get("tie_word_embeddings", True),
    )

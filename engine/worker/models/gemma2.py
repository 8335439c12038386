"""Gemma 2 (transformers' `Gemma2ForCausalLM`), on Gemma 3's parts.

Gemma 2 is Gemma 3's layer outline (four norms a layer, scaled embeddings, tied LM head, the
tanh GELU, attention scaled by query_pre_attn_scalar ** -0.5) without q/k norms and with one
RoPE for every layer, plus two soft-caps, each x -> cap * tanh(x / cap) as transformers computes
it: on attention scores (`attn_logit_softcapping`, see `softcap_attention`) and on the final
logits (`final_logit_softcapping`). Layers alternate sliding (even indexes) and full, as
`layer_types` says or, in configs without it, as Gemma 2 was released. A setting left out of
config.json takes Gemma2Config's default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.models.gemma3 import (
    _ACTIVATION,
    SLIDING,
    Gemma3DecoderLayer,
    GemmaRMSNorm,
    ScaledEmbedding,
    layer_types,
)
from pagedbatch.engine.worker.models.llama import Attention, LlamaForCausalLM
from pagedbatch.engine.worker.models.rope import RotaryEmbedding
from pagedbatch.engine.worker.models.softcap_attention import softcapped_paged_attention
from pagedbatch.engine.worker.parallel_layers import EVERY_TOKEN
from pagedbatch.kernels.attention import AttentionMetadata

# Gemma2Config's defaults, for configs that leave a setting out.
_DEFAULTS: dict[str, Any] = {
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 2,  # every other layer full, as in `layer_types`' absence
    "hidden_activation": _ACTIVATION,
    "tie_word_embeddings": True,
}


class Gemma2Attention(Attention):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        query_pre_attn_scalar: float,
    ):
        super().__init__(cfg, rotary, sliding_window)
        self.scale = query_pre_attn_scalar**-0.5
        self.softcap: float | None = _setting(cfg.raw, "attn_logit_softcapping")

    def attend(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.softcap is None:
            return super().attend(q, key_cache, value_cache, meta)
        return softcapped_paged_attention(
            q, key_cache, value_cache, meta, self.scale, self.softcap, self.sliding_window
        )


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    attention_class = Gemma2Attention


class Gemma2ForCausalLM(LlamaForCausalLM):
    embedding_class = ScaledEmbedding
    norm_class = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig):
        activation = _setting(cfg.raw, "hidden_activation")
        if activation != _ACTIVATION:
            raise ValueError(
                f"Gemma 2 with hidden_activation={activation!r} is not supported "
                f"(only {_ACTIVATION})"
            )
        window = _setting(cfg.raw, "sliding_window")
        kinds = layer_types({"sliding_window_pattern": 2} | cfg.raw)
        super().__init__(
            dataclasses.replace(
                cfg,
                sliding_windows=[window if kind == SLIDING else None for kind in kinds],
                tie_word_embeddings=_setting(cfg.raw, "tie_word_embeddings"),
            )
        )
        self.final_softcap: float | None = _setting(cfg.raw, "final_logit_softcapping")

    def decoder_layers(self, cfg: ModelConfig) -> list[nn.Module]:
        rotary = RotaryEmbedding.from_config(cfg.raw, cfg.head_dim, cfg.max_position_embeddings)
        scalar = _setting(cfg.raw, "query_pre_attn_scalar")
        return [Gemma2DecoderLayer(cfg, rotary, window, scalar) for window in cfg.sliding_windows]

    def compute_logits(self, hidden: torch.Tensor, vocab: slice = EVERY_TOKEN) -> torch.Tensor:
        logits = super().compute_logits(hidden, vocab)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


def _setting(raw: dict[str, Any], key: str) -> Any:
    return raw.get(key, _DEFAULTS[key])

"""Rotary position embeddings from a Hugging Face config.

Each RoPE type's inverse frequencies are computed with the same tensor operations, in the same
order, as transformers 5's `ROPE_INIT_FUNCTIONS` (modeling_rope_utils.py), so the cos/sin table, and
the rotated queries and keys, equal transformers' in float32.

Dynamic NTK: transformers recomputes the frequencies in a forward whose largest position id P has
P + 1 > max_position_embeddings, for seq_len = P + 1, and rotates every token of that forward with
them; the keys it caches keep the rotation of the step that produced them. We do the same per
sequence: `forward` takes each token's `seq_len` (its sequence's context length at the end of this
step, `AttentionMetadata.rope_seq_lens`) and, for tokens whose seq_len exceeds the original maximum,
computes cos/sin on the fly for that seq_len. This equals transformers for one sequence generated in
one prefill then token by token. It differs where transformers shares one seq_len across a padded
batch, carries the largest seen across `generate` calls, or sees a prompt in one forward that we
prefill in chunks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pagedbatch.kernels import ops

DEFAULT_THETA = 10_000.0
# Rows of the cos/sin table written at a time (see `RotaryEmbedding.cover`).
FILL_ROWS = 512


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a config.json, written either the transformers 5 way
    (`rope_parameters`) or the older way (`rope_theta` beside a `rope_scaling` dict), normalised as
    transformers' `standardize_rope_params` does."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", DEFAULT_THETA))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn"):
        # A top-level value wins, as in transformers (Phi-3 style configs keep it there).
        if "original_max_position_embeddings" in config:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return params


class RotaryEmbedding(nn.Module):
    """Rotates queries and keys by position; shared by every layer of a model."""

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        params: Mapping[str, Any],
        max_positions: int | None = None,
    ):
        """`params` as `rope_parameters` returns them. The cos/sin table covers `max_positions`
        positions, by default as many as the RoPE type is meant to reach."""
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in _INIT:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {sorted(_INIT)}")
        # transformers' Llama ignores the factor for the default type and fails on it otherwise.
        if rope_type != "default" and params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.params = dict(params)
        self.rope_type = rope_type
        inv_freq, self.attention_scaling = _INIT[rope_type](
            self.params, head_dim, max_position_embeddings
        )
        num_positions = max_positions or _reach(self.params, max_position_embeddings)
        if rope_type == "dynamic":  # longer contexts get their frequencies in forward
            num_positions = min(num_positions, max_position_embeddings)
        self.inv_freq = inv_freq
        # On the CPU, rows are written as steps reach them (`cover`), in place: a table of
        # 32,768 positions of 256-wide heads is 32 MiB, of which chats touch a few hundred rows,
        # and pages never written are never resident. Kernels keep the table's address
        # (decode_layer.c; CUDA graphs).
        self.cos_sin_cache: torch.Tensor
        self.register_buffer(
            "cos_sin_cache", torch.empty(num_positions, head_dim), persistent=False
        )
        self.covered = 0
        if self.cos_sin_cache.device.type != "cpu":  # device memory is taken whole anyway
            self.cover(num_positions)

    def cover(self, positions: int) -> None:
        """Makes the table's rows for positions 0 .. positions - 1 valid (every row, past its
        end). The model covers each step's longest context before its layers run.
        Whole chunks of FILL_ROWS rows: each chunk's D/2 cosines a row fill whole vectors of any
        width, so they equal those of the whole table computed at once."""
        table = self.cos_sin_cache
        end = min(-(-positions // FILL_ROWS) * FILL_ROWS, table.shape[0])
        if end <= self.covered:
            return
        rows = torch.arange(self.covered, end, device=table.device)
        inv_freq = self.inv_freq.to(table.device)
        table[self.covered : end] = _cos_sin(rows, inv_freq, self.attention_scaling)
        self.covered = end

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], head_dim: int, max_positions: int | None = None
    ) -> RotaryEmbedding:
        """From a config.json's contents."""
        return cls(
            head_dim, config["max_position_embeddings"], rope_parameters(config), max_positions
        )

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates query `[T, num_heads, D]` and key `[T, num_kv_heads, D]` of tokens at
        `positions` `[T]`. `seq_lens` `[T]` matters only to dynamic NTK (see the module doc)."""
        cos_sin = self.cos_sin_cache
        if self.rope_type == "dynamic" and seq_lens is not None:
            long = seq_lens > self.max_position_embeddings
            if bool(long.any()):
                # A per-token table for this step: cached rows where they apply, fresh ones where
                # the context outgrew the original length.
                last_row = cos_sin.shape[0] - 1
                cos_sin = cos_sin.index_select(0, positions.clamp(max=last_row))
                fresh = self._dynamic_cos_sin(positions[long], seq_lens[long])
                cos_sin[long] = fresh.to(cos_sin.dtype)
                positions = torch.arange(positions.numel(), device=positions.device)
        return ops.apply_rotary_embedding(positions, query, key, cos_sin)

    def _dynamic_cos_sin(self, positions: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        # transformers' _compute_dynamic_ntk_parameters with a tensor seq_len, one per token.
        dim = self.head_dim
        factor = self.params["factor"]
        max_pos = self.max_position_embeddings
        growth = (factor * seq_lens / max_pos) - (factor - 1)
        base = self.params["rope_theta"] * growth ** (dim / (dim - 2))
        exponent = _arange_even(dim, positions.device) / dim
        inv_freq = 1.0 / (base[:, None] ** exponent)
        return _cos_sin(positions, inv_freq, 1.0)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """Rows of D/2 cosines then D/2 sines; inv_freq is `[D/2]` or one row per position."""
    freqs = positions[:, None].float() * inv_freq
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


def _arange_even(dim: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(dtype=torch.float)


def _reach(params: Mapping[str, Any], max_position_embeddings: int) -> int:
    """How many positions the RoPE type is meant to cover."""
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return int(max_position_embeddings * params["factor"])
    if rope_type in ("llama3", "yarn"):
        extended = params["original_max_position_embeddings"] * (params.get("factor") or 1)
        return max(max_position_embeddings, int(extended))
    return max_position_embeddings


# Each returns (inv_freq, attention_scaling), as transformers' ROPE_INIT_FUNCTIONS do.


def _default(params: Mapping[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _linear(params: Mapping[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (params["rope_theta"] ** (_arange_even(dim) / dim))
    inv_freq /= params["factor"]
    return inv_freq, 1.0


def _dynamic(params: Mapping[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    # The frequencies for a context of max_pos tokens; longer ones are computed in forward.
    factor = params["factor"]
    base = params["rope_theta"] * ((factor * max_pos / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (_arange_even(dim) / dim)), 1.0


def _llama3(params: Mapping[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (params["rope_theta"] ** (_arange_even(dim) / dim))
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by the factor, short ones kept, the band between interpolated.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    interpolated = (1 - smooth_factor) * inv_freq_llama / factor
    smoothed_inv_freq = interpolated + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama), 1.0


def _yarn(params: Mapping[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_pos / original_max

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            ratio = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            attention_factor = float(ratio)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        """The dimension whose wavelength fits num_rotations times in the original context."""
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    # 0 keeps a dimension's original frequency (extrapolation), 1 interpolates it.
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, attention_factor


_INIT = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
}

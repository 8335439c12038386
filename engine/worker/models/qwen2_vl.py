"""Qwen2-VL: images at their own resolution through a ViT, into a Qwen2 with M-RoPE.

The processor resizes an image (keeping its shape) to a grid of 14x14 patches, each a row of
pixel values over two frames (an image repeats its one frame). The ViT rotates each patch's
queries and keys by its (row, column), attends within its image only, and a merger folds every
2x2 patches into one embedding for the language model. There, M-RoPE splits each head's rotary
frequencies into three sections, rotated by a token's position along time, height and width:
text counts up on all three, an image's embeddings sit on their grid (engine/multimodal/inputs.py,
`mrope_positions`). The runner hands the language model those `[3, tokens]` positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.multimodal.inputs import Grid, MediaItem
from pagedbatch.engine.worker.models.clip import VisionMLP
from pagedbatch.engine.worker.models.llama import LlamaForCausalLM
from pagedbatch.engine.worker.models.multimodal import MultimodalModel
from pagedbatch.engine.worker.models.rope import RotaryEmbedding
from pagedbatch.kernels import ops

VISION_NORM_EPS = 1e-6


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: positions `[3, T]` pick, per frequency, the row of its section (time, height,
    width); positions `[T]` (a step of text alone) rotate as plain RoPE."""

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        params: Mapping[str, Any],
        max_positions: int | None = None,
    ):
        super().__init__(head_dim, max_position_embeddings, params, max_positions)
        sections = params["mrope_section"]
        if sum(sections) != head_dim // 2 or len(sections) != 3:
            raise ValueError(f"mrope_section {sections} must be three parts of {head_dim // 2}")
        section = torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
        # The table's columns: head_dim/2 cosines then as many sines, each of its frequency.
        self.section_of_column: torch.Tensor
        self.register_buffer("section_of_column", torch.cat([section, section]), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, query, key, seq_lens)
        # Row t of the per-token table takes column c from the table's row positions[s(c), t].
        rows = positions[self.section_of_column].T
        per_token = self.cos_sin_cache.gather(0, rows)
        tokens = torch.arange(rows.shape[0], device=positions.device)
        return ops.apply_rotary_embedding(tokens, query, key, per_token)


class Qwen2VLTextModel(LlamaForCausalLM):
    """Qwen2 with M-RoPE."""

    rotary_class = MRotaryEmbedding


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, lengths: list[int], cos_sin: torch.Tensor) -> torch.Tensor:
        """`x` holds the patches of several images, `lengths` of each; each attends within its
        own image. Row i of `cos_sin` rotates patch i (see `ops.apply_rotary_embedding`)."""
        tokens = x.shape[0]
        q, k, v = self.qkv(x).reshape(tokens, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        # Rotated in float32, as transformers does whatever the weights' dtype.
        patches = torch.arange(tokens, device=x.device)
        q, k = ops.apply_rotary_embedding(patches, q.float(), k.float(), cos_sin)
        q, k = q.to(v.dtype), k.to(v.dtype)
        heads = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, heads, tokens, dim]
        out = [
            F.scaled_dot_product_attention(qi, ki, vi)
            for qi, ki, vi in zip(*(h.split(lengths, dim=2) for h in heads), strict=True)
        ]
        return self.proj(torch.cat(out, dim=2).squeeze(0).transpose(0, 1).reshape(tokens, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim = cfg["embed_dim"]
        self.norm1 = nn.LayerNorm(dim, eps=VISION_NORM_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=VISION_NORM_EPS)
        self.attn = VisionAttention(dim, cfg["num_heads"])
        self.mlp = VisionMLP(
            dim, dim * cfg.get("mlp_ratio", 4), cfg.get("hidden_act", "quick_gelu")
        )

    def forward(self, x: torch.Tensor, lengths: list[int], cos_sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos_sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        patch, frames = cfg.get("patch_size", 14), cfg.get("temporal_patch_size", 2)
        self.shape = (cfg.get("in_channels", 3), frames, patch, patch)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(self.shape[0], cfg["embed_dim"], kernel, stride=kernel, bias=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Patch rows `[patches, channels x frames x patch x patch]` to `[patches, embed_dim]`."""
        return self.proj(rows.view(-1, *self.shape)).view(rows.shape[0], -1)


class PatchMerger(nn.Module):
    def __init__(self, dim: int, out_dim: int, merge: int):
        super().__init__()
        self.merged = dim * merge * merge
        self.ln_q = nn.LayerNorm(dim, eps=VISION_NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The processor lays each 2x2 block's patches out together: they fold into one row."""
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.merge = cfg.get("spatial_merge_size", 2)
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg["depth"]))
        self.merger = PatchMerger(cfg["embed_dim"], cfg["hidden_size"], self.merge)
        # 2-D rotary: a quarter of each head's dimensions per axis, rows then columns.
        quarter = cfg["embed_dim"] // cfg["num_heads"] // 2
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        exponent = torch.arange(0, quarter, 2, dtype=torch.float) / quarter
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / (theta**exponent), persistent=False)

    def forward(self, rows: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """The patch rows of several images, each image's in its processor's order, to one
        embedding per 2x2 patches."""
        lengths = [t * h * w for t, h, w in grids]
        positions = torch.cat([self._patch_positions(grid) for grid in grids]).to(rows.device)
        freqs = (positions[..., None].float() * self.inv_freq).flatten(1)  # [patches, dim/2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # a row per patch
        x = self.patch_embed(rows)
        for block in self.blocks:
            x = block(x, lengths, cos_sin)
        return self.merger(x)

    def _patch_positions(self, grid: Grid) -> torch.Tensor:
        """Each patch's (row, column), `[patches, 2]`, in the processor's order: 2x2 blocks in
        row-major order, each block's patches row-major; every frame alike."""
        frames, height, width = grid
        m = self.merge
        rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        blocks = (height // m, m, width // m, m)
        rows = rows.reshape(blocks).transpose(1, 2).flatten()
        cols = cols.reshape(blocks).transpose(1, 2).flatten()
        return torch.stack([rows, cols], dim=-1).repeat(frames, 1)


class Qwen2VLForConditionalGeneration(MultimodalModel):
    # As transformers saves Qwen2-VL (and the hub's checkpoints are), and as it holds it in
    # memory (model.visual, model.language_model).
    PREFIXES = (
        ("model.visual.", "visual."),
        ("visual.", "visual."),
        ("model.language_model.", ""),
        ("model.", ""),
    )

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.multimodal is None:
            raise ValueError("a Qwen2-VL config.json has text_config and vision_config")
        self.visual = Qwen2VisionTransformer(cfg.multimodal["vision_config"])
        self.language_model = Qwen2VLTextModel(cfg)

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Every image at once: patches side by side, attention kept within each image."""
        weight = self.visual.patch_embed.proj.weight
        rows = torch.cat([item.values for item in items]).to(weight)
        embeds = self.visual(rows, [item.grid for item in items])
        return list(embeds.split([item.length for item in items]))

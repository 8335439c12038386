"""CLIP's vision tower (ViT-L/14 in LLaVA-1.5): image patches in, one hidden state per patch out.

It runs once per image, on whole images batched over a step's new ones; unlike the language
model it keeps no cache and attends bidirectionally over one image's patches. It is small beside
the language model and is not split across tensor-parallel ranks: every rank runs all of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
}


def activation(name: str) -> Any:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class VisionEmbeddings(nn.Module):
    def __init__(self, hidden: int, channels: int, patch: int, num_patches: int):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(channels, hidden, patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding(num_patches + 1, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[images, channels, H, W]` to `[images, 1 + patches, hidden]`, the class token first."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, tokens, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(images, tokens, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.out_proj(out.transpose(1, 2).reshape(images, tokens, hidden))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = VisionAttention(hidden, cfg["num_attention_heads"])
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = VisionMLP(hidden, cfg["intermediate_size"], cfg.get("hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: dict[str, Any], num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class CLIPVisionTower(nn.Module):
    """`cfg` is a CLIPVisionConfig as config.json holds it. Only the first `num_layers` layers
    are built and run: LLaVA reads an inner layer's output, so the ones after it (and the final
    norm) would be wasted work."""

    def __init__(self, cfg: dict[str, Any], num_layers: int):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.image_size = cfg["image_size"]
        self.patch_size = cfg["patch_size"]
        self.num_patches = (self.image_size // self.patch_size) ** 2
        self.embeddings = VisionEmbeddings(
            hidden, cfg.get("num_channels", 3), self.patch_size, self.num_patches
        )
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_eps", 1e-5))
        self.encoder = VisionEncoder(cfg, num_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[images, channels, image_size, image_size]` to the last built layer's output,
        `[images, 1 + patches, hidden]`."""
        return self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)))

"""Qwen2-Audio: a Whisper-style audio encoder, 2x average pooling, a linear projector and our
Qwen2.

The encoder reads a clip's log-mel frames through two convolutions (GELU after each, the second
halving the frames), adds fixed sinusoidal positions, and runs pre-norm layers that attend over
the whole clip; pooling pairs of positions gives one embedding per 40 ms. transformers runs every
clip padded to 30 s with the padding's keys masked out; we run each clip over its own frames
(multimodal/audio.py keeps the two past its end that the convolutions read), which gives the same
embeddings for what the clip holds at a fraction of the work for a short one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.multimodal.inputs import MediaItem
from pagedbatch.engine.worker.models.clip import activation
from pagedbatch.engine.worker.models.llama import LlamaForCausalLM
from pagedbatch.engine.worker.models.multimodal import MultimodalModel


class AudioAttention(nn.Module):
    """Whisper's: the key projection has no bias, and queries are scaled before the product (as
    transformers does, for the same rounding)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.scaling = (dim // num_heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions, dim = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(positions, self.num_heads, -1).transpose(0, 1)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x) * self.scaling),
            heads(self.k_proj(x)),
            heads(self.v_proj(x)),
            scale=1.0,
        )
        return self.out_proj(out.transpose(0, 1).reshape(positions, dim))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim = cfg["d_model"]
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = AudioAttention(dim, cfg["encoder_attention_heads"])
        self.final_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, cfg["encoder_ffn_dim"])
        self.fc2 = nn.Linear(cfg["encoder_ffn_dim"], dim)
        self.act = activation(cfg.get("activation_function", "gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """`cfg` is the audio_config of a Qwen2-Audio config.json."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim, mels = cfg["d_model"], cfg.get("num_mel_bins", 128)
        if cfg.get("scale_embedding"):
            raise ValueError("audio_config.scale_embedding is not supported (Qwen2-Audio's: off)")
        self.conv1 = nn.Conv1d(mels, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.get("max_source_positions", 1500), dim)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg["encoder_layers"]))
        self.layer_norm = nn.LayerNorm(dim)

    def forward(self, features: torch.Tensor, frames: int) -> torch.Tensor:
        """A clip's `[mel_bins, frames + edge]` features to its `[tokens, d_model]` states."""
        x = F.gelu(self.conv1(features[None]))
        x = F.gelu(self.conv2(x))[0]
        positions = (frames - 1) // 2 + 1  # the convolved frames of the clip itself
        x = x[:, :positions].T + self.embed_positions.weight[:positions]
        for layer in self.layers:
            x = layer(x)
        x = F.avg_pool1d(x.T[None], kernel_size=2, stride=2)[0].T
        return self.layer_norm(x)


class Projector(nn.Module):
    def __init__(self, audio_dim: int, text_dim: int):
        super().__init__()
        self.linear = nn.Linear(audio_dim, text_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioForConditionalGeneration(MultimodalModel):
    # As transformers saves Qwen2-Audio (the language model's names within it as a Qwen2's), and
    # as it holds it in memory (model.*).
    PREFIXES = (
        ("language_model.", ""),
        ("model.language_model.", ""),
        ("audio_tower.", "audio_tower."),
        ("model.audio_tower.", "audio_tower."),
        ("multi_modal_projector.", "multi_modal_projector."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        top = cfg.multimodal
        if top is None or "audio_config" not in top:
            raise ValueError("a Qwen2-Audio config.json has text_config and audio_config")
        audio = top["audio_config"]
        self.audio_tower = AudioEncoder(audio)
        self.multi_modal_projector = Projector(audio["d_model"], cfg.hidden_size)
        self.language_model = LlamaForCausalLM(cfg)

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Clip by clip: each runs over its own length."""
        weight = self.multi_modal_projector.linear.weight
        return [
            self.multi_modal_projector(self.audio_tower(item.values.to(weight), item.frames))
            for item in items
        ]

"""LLaVA-1.5: a CLIP vision tower, a two-layer MLP projector and our Llama.

Every image is resized to the tower's one square and becomes one embedding per patch (CLIP's class
token dropped under the "default" feature strategy), which take the places of as many image
tokens in the prompt; the rest is the Llama's forward pass over the paged KV cache, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.multimodal.inputs import MediaItem
from pagedbatch.engine.worker.models.clip import CLIPVisionTower, activation
from pagedbatch.engine.worker.models.llama import LlamaForCausalLM
from pagedbatch.engine.worker.models.multimodal import MultimodalModel


class Projector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(MultimodalModel):
    # As transformers saves LLaVA (the language model's names within it as a Llama's), as it
    # holds it in memory (model.*), and as older hub checkpoints name the tower (vision_model).
    PREFIXES = (
        ("language_model.", ""),
        ("model.language_model.", ""),
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("multi_modal_projector.", "multi_modal_projector."),
    )

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        top = cfg.multimodal
        if top is None:
            raise ValueError("a LLaVA config.json has text_config and vision_config")
        vision: dict[str, Any] = top["vision_config"]
        feature_layer = top.get("vision_feature_layer", -2)
        if not isinstance(feature_layer, int):
            raise ValueError("vision_feature_layer must be one layer (LLaVA-1.5's -2)")
        # hidden_states[k] is the output of k layers (0: the embeddings), counted from the end
        # when negative.
        layers = vision["num_hidden_layers"]
        depth = feature_layer if feature_layer >= 0 else layers + 1 + feature_layer
        self.strategy = top.get("vision_feature_select_strategy", "default")
        if self.strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {self.strategy!r}")
        self.vision_tower = CLIPVisionTower(vision, depth)
        self.multi_modal_projector = Projector(
            vision["hidden_size"],
            cfg.hidden_size,
            top.get("projector_hidden_act", "gelu"),
            top.get("multimodal_projector_bias", True),
        )
        self.language_model = LlamaForCausalLM(cfg)

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Every image at once: they all have the one shape LLaVA reads."""
        weight = self.multi_modal_projector.linear_1.weight
        pixels = torch.stack([item.values for item in items]).to(weight)
        features = self.vision_tower(pixels)
        if self.strategy == "default":
            features = features[:, 1:]
        return list(self.multi_modal_projector(features))

    def unused(self, name: str) -> bool:
        """The tower's layers after the feature layer, and its final norm."""
        return name.startswith(("vision_tower.encoder.layers.", "vision_tower.post_layernorm."))

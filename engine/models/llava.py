"""LLaVA-1.5: a CLIP vision tower, a two-layer MLP projector and our Llama.

An image becomes `tokens_per_image` embeddings (one per patch; CLIP's class token dropped under
the "default" feature strategy), which take the places of that many image tokens in the prompt.
The engine encodes each image once (`encode_images`), keeps the result in its encoder cache and
hands each step the rows of its batch that hold image positions with their embeddings; the rest
is the Llama's forward pass over the paged KV cache, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.models.clip import CLIPVisionTower, activation
from pagedbatch.engine.models.llama import KVCache, LlamaForCausalLM
from pagedbatch.engine.parallel_layers import Loaded, default_weight_loader
from pagedbatch.kernels.attention import AttentionMetadata

# Where transformers puts each part: as it saves LLaVA (the first two), as it holds it in
# memory (model.*), and as older hub checkpoints name the vision tower (vision_model).
_LANGUAGE_PREFIXES = ("language_model.", "model.language_model.")
_VISION_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class Projector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
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
        depth = (
            feature_layer if feature_layer >= 0 else vision["num_hidden_layers"] + 1 + feature_layer
        )
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
        patches = self.vision_tower.num_patches
        self.tokens_per_image = patches if self.strategy == "default" else patches + 1

    def image_shape(self) -> tuple[int, int, int]:
        """The pixel values the tower reads for one image: channels, height, width."""
        side = self.vision_tower.image_size
        return (3, side, side)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`[images, 3, H, W]` to `[images, tokens_per_image, hidden_size]`."""
        features = self.vision_tower(pixel_values.to(self.multi_modal_projector.linear_1.weight))
        if self.strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The Llama's forward pass, with `image_embeds` in the batch rows `image_rows` instead of
        their image tokens' embeddings."""
        x = self.language_model.embed_tokens(input_ids)
        if image_rows is not None:
            x[image_rows] = image_embeds.to(x.dtype)
        return self.language_model(input_ids, positions, kv_caches, meta, inputs_embeds=x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Splits the checkpoint among the three parts; the tower's layers past the one LLaVA
        reads, and its final norm, are skipped."""
        language: list[tuple[str, Loaded]] = []
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if (rest := _strip(name, _LANGUAGE_PREFIXES)) is not None:
                language.append((rest, tensor))
                continue
            if name == "lm_head.weight":  # transformers' in-memory name
                language.append((name, tensor))
                continue
            if (rest := _strip(name, _VISION_PREFIXES)) is not None:
                target = f"vision_tower.{rest}"
            elif (rest := _strip(name, _PROJECTOR_PREFIXES)) is not None:
                target = f"multi_modal_projector.{rest}"
            else:
                raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
            if target not in own:
                if target.startswith("vision_tower.") and _unused_by_llava(rest):
                    continue
                raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
            try:
                default_weight_loader(own[target], tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} {e}") from e
            loaded.add(target)
        self.language_model.load_weights(language)
        expected = {n for n in own if not n.startswith("language_model.")}
        if missing := sorted(expected - loaded):
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(missing[:8])}")


def _strip(name: str, prefixes: tuple[str, ...]) -> str | None:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name.removeprefix(prefix)
    return None


def _unused_by_llava(rest: str) -> bool:
    """Tower tensors after the feature layer: later encoder layers and the final norm."""
    return rest.startswith(("encoder.layers.", "post_layernorm."))

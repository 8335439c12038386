"""What every vision- or audio-language model shares: a language model whose image or audio
positions take encoder outputs, and a checkpoint split between the two.

A subclass builds `language_model` (one of our decoders) and its encoder parts, and says in
`PREFIXES` where transformers puts each part's tensors; it encodes images or clips with
`encode(items)`, one tensor of embeddings per item. The engine keeps those in its encoder cache
and hands each step the batch rows that hold media positions with their embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedbatch.engine.multimodal.inputs import MediaItem
from pagedbatch.engine.worker.models.llama import KVCache, LlamaForCausalLM
from pagedbatch.engine.worker.models.weights import ParameterLoads
from pagedbatch.engine.worker.parallel_layers import EVERY_TOKEN, Loaded
from pagedbatch.kernels.attention import AttentionMetadata
from pagedbatch.kernels.quant_linear import QuantizedWeight


class MultimodalModel(nn.Module):
    language_model: LlamaForCausalLM
    # (checkpoint name prefix, what it becomes), first match wins: a parameter prefix of this
    # model's own, or "" for the language model (which takes the rest of the name, as a text
    # checkpoint names it).
    PREFIXES: tuple[tuple[str, str], ...] = ()

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Each item's embeddings, `[item.length, hidden_size]`."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        media_rows: torch.Tensor | None = None,
        media_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The language model's forward pass, with `media_embeds` in the batch rows `media_rows`
        instead of their placeholder tokens' embeddings."""
        x = self.language_model.embed_tokens(input_ids)
        if media_rows is not None:
            x[media_rows] = media_embeds.to(x.dtype)
        return self.language_model(input_ids, positions, kv_caches, meta, inputs_embeds=x)

    def compute_logits(self, hidden: torch.Tensor, vocab: slice = EVERY_TOKEN) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, vocab)

    @property
    def slices_vocabulary(self) -> bool:
        return self.language_model.slices_vocabulary

    @property
    def screen(self) -> QuantizedWeight | None:
        return self.language_model.screen

    def unused(self, name: str) -> bool:
        """Whether a checkpoint tensor of the encoder parts, named as this model names its own, is
        one the model does without (LLaVA's tower layers past the one it reads)."""
        return False

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        language: list[tuple[str, Loaded]] = []
        loads = ParameterLoads(self)
        for name, tensor in weights:
            target = self._target(name)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
            if target.startswith("language_model."):
                language.append((target.removeprefix("language_model."), tensor))
            elif target in loads or not self.unused(target):
                loads.load(name, target, tensor)
        self.language_model.load_weights(language)
        loads.check_complete(except_under="language_model.")

    def _target(self, name: str) -> str | None:
        if name == "lm_head.weight":
            return "language_model.lm_head.weight"
        for prefix, target in self.PREFIXES:
            if name.startswith(prefix):
                rest = name.removeprefix(prefix)
                return f"{target or 'language_model.'}{rest}"
        return None

"""Qwen3-MoE (transformers' `Qwen3MoeForCausalLM`): Qwen3's attention (q/k norms), and in place
of its MLP a mixture of experts (see `moe`) of `moe_intermediate_size` each, their top-k
probabilities renormalised where `norm_topk_prob` says so. Every layer is a mixture, as in every
Qwen3-MoE released; configs with dense layers among them (`mlp_only_layers`,
`decoder_sparse_step`) are refused rather than misread."""

from __future__ import annotations

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.models.llama import LlamaForCausalLM
from pagedbatch.engine.worker.models.moe import SparseMoeBlock, expert_parameter
from pagedbatch.engine.worker.models.qwen3 import Qwen3DecoderLayer

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Qwen3MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, cfg: ModelConfig):
        raw = cfg.raw
        super().__init__(
            cfg.hidden_size,
            raw.get("num_experts") or raw["num_local_experts"],
            raw["num_experts_per_tok"],
            raw["moe_intermediate_size"],
            renormalize=raw.get("norm_topk_prob", False),
            weights_in_input_dtype=True,
        )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    mlp_class = Qwen3MoeSparseMoeBlock


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_class = Qwen3MoeDecoderLayer

    def __init__(self, cfg: ModelConfig):
        if cfg.raw.get("mlp_only_layers") or cfg.raw.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                "Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step other than 1) "
                "is not supported"
            )
        super().__init__(cfg)

    def parameter_for(self, name: str) -> tuple[str, int | None]:
        return expert_parameter(name, _PROJECTIONS) or super().parameter_for(name)

"""Mixtral (transformers' `MixtralForCausalLM`): Mistral's attention, and in place of its MLP a
mixture of experts (see `moe`) whose top-k probabilities are renormalised. The checkpoint names
the mixture `block_sparse_moe` and each expert's gate, down and up projections w1, w2 and w3, as
the models on the Hub are saved."""

from __future__ import annotations

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.models.llama import DecoderLayer, LlamaForCausalLM
from pagedbatch.engine.worker.models.moe import SparseMoeBlock, expert_parameter

_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down


class MixtralSparseMoeBlock(SparseMoeBlock):
    def __init__(self, cfg: ModelConfig):
        super().__init__(
            cfg.hidden_size,
            cfg.raw["num_local_experts"],
            cfg.raw["num_experts_per_tok"],
            cfg.intermediate_size,
            renormalize=True,
            weights_in_input_dtype=False,
        )


class MixtralDecoderLayer(DecoderLayer):
    mlp_class = MixtralSparseMoeBlock


class MixtralForCausalLM(LlamaForCausalLM):
    layer_class = MixtralDecoderLayer

    def parameter_for(self, name: str) -> tuple[str, int | None]:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_parameter(name, _PROJECTIONS) or super().parameter_for(name)

"""Which model class runs a checkpoint, chosen by config.json `architectures`.

Plugins add architectures through the entry-point group `pagedbatch.models`: the entry point's
name is the architecture (as config.json spells it), its value the model class, for example
`MyForCausalLM = "my_plugin.model:MyForCausalLM"`.

A model class is built as `cls(model_config)` under `distributed.building_for(tp)`, and loaded with
`load_weights(pairs)`, pairs of a checkpoint name and a `loader.CheckpointTensor` (index it to
read: `t[:]` is the whole tensor). Classes built from `parallel_layers` run tensor-parallel.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import torch

from pagedbatch.engine.worker.models.bert import BertModel
from pagedbatch.engine.worker.models.gemma2 import Gemma2ForCausalLM
from pagedbatch.engine.worker.models.gemma3 import Gemma3ForCausalLM
from pagedbatch.engine.worker.models.llama import LlamaForCausalLM, LlamaForSequenceClassification
from pagedbatch.engine.worker.models.llava import LlavaForConditionalGeneration
from pagedbatch.engine.worker.models.mixtral import MixtralForCausalLM
from pagedbatch.engine.worker.models.phi3 import Phi3ForCausalLM
from pagedbatch.engine.worker.models.qwen2_audio import Qwen2AudioForConditionalGeneration
from pagedbatch.engine.worker.models.qwen2_vl import Qwen2VLForConditionalGeneration
from pagedbatch.engine.worker.models.qwen3 import Qwen3ForCausalLM
from pagedbatch.engine.worker.models.qwen3_moe import Qwen3MoeForCausalLM

ENTRY_POINT_GROUP = "pagedbatch.models"

_BUILTIN: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    # Embedding models: an encoder, and decoders without their LM head (see ModelConfig.pooling).
    "BertModel": BertModel,
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": LlamaForSequenceClassification,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2AudioForConditionalGeneration": Qwen2AudioForConditionalGeneration,
}


def supported_architectures() -> list[str]:
    return sorted(set(_BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def resolve_model_class(architecture: str) -> type[torch.nn.Module]:
    if architecture in _BUILTIN:
        return _BUILTIN[architecture]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == architecture:
            return ep.load()
    raise ValueError(
        f"unsupported model architecture {architecture!r}; supported: "
        + ", ".join(supported_architectures())
    )

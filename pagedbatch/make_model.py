"""Deterministic, randomly initialised Hugging Face checkpoints for tests, demos and benchmarks.

A checkpoint initialised the usual way (small Gaussian weights) barely looks at its context: its
greedy output repeats one token whatever the prompt, so an engine test built on it could not tell
a correct KV cache from a broken one. These weights are scaled instead so that the model behaves
like a context-hungry language model:

- q and k projections are scaled so that attention scores have a standard deviation of about
  two: each head attends to a handful of positions, chosen by content and (through RoPE) relative
  position, anywhere in the context. Sharper attention would amplify float32 rounding, and so
  make near-ties between the top two logits, where two float32 implementations may disagree,
  more frequent;
- v and o projections write attention outputs larger than the token embeddings, so what a head
  reads changes the residual stream and therefore the prediction;
- the LM head gives logits with a standard deviation of about five, a spread like a trained
  model's: sampling at temperature 1 is neither uniform nor greedy;
- norm weights and Qwen2's biases are random rather than ones and zeros, so an engine that skips
  them produces different tokens;
- Gemma 3, which normalises queries, keys and what each sublayer writes, and ties its LM head to
  its embeddings, gets the same behaviour from its norms' scales, its query_pre_attn_scalar and
  small embeddings (see GEMMA_EMBED_RMS).

Every tensor is drawn from its own generator, seeded from the model seed and the tensor's name:
the same arguments give the same bytes, and config overrides that keep a tensor's shape (a
sliding window, RoPE scaling) keep its values, so such variants differ from the base model only
where the override acts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagedbatch.demo_tokenizer import (
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKEN_IDS,
    VOCAB_SIZE,
    write_tokenizer,
)

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int


SIZES = {
    "tiny": ModelSize(128, 4, 4, 2, 384, 2048),  # about 5M parameters, for unit tests
    "small": ModelSize(768, 12, 12, 4, 2048, 4096),  # about 100M, for CPU benchmarks
    "medium": ModelSize(1536, 20, 12, 4, 4096, 4096),  # about 0.5B, for GPU benchmarks
}

# Standard deviations of projection outputs for unit-RMS inputs (see the module docstring).
QK_SCALE = 1.5
O_SCALE = 1.5
MLP_SCALE = 1.0
LM_HEAD_SCALE = 5.0
# Larger v biases would add the same vector at every position and narrow the choice of tokens.
BIAS_SCALE = 0.2
QWEN2_BIASES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# Gemma 3 normalises what attention and the MLP write (post-attention and post-feedforward norms):
# those norms' scales, not the o and down projections', set how much each sublayer writes.
GEMMA_SUBLAYER_SCALE = 1.5
# Gemma 3 ties its LM head to its embeddings, so a token's embedding favours the token itself as
# the next one: where embeddings dominate the residual stream, greedy output cycles through a few
# tokens. They enter it at this RMS (after Gemma's sqrt(hidden) scaling), well below what the
# sublayers write; the final norm's scale then gives the logits their spread.
GEMMA_EMBED_RMS = 0.25


def model_config(
    arch: str = "llama", size: str = "tiny", config_overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The config.json of a generated checkpoint, overrides merged in last."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    shape = SIZES[size]
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.hidden_size // shape.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "bos_token_id": SPECIAL_TOKEN_IDS[ENDOFTEXT],
        "eos_token_id": SPECIAL_TOKEN_IDS[IM_END],
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }
    if arch == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    elif arch == "qwen2":
        # Qwen2 always has q/k/v biases; its config says nothing of them. With the window switched
        # on by overrides, layers from max_window_layers on slide: half the layers, a mix to test.
        config |= {"use_sliding_window": False, "sliding_window": None}
        config["max_window_layers"] = shape.num_layers // 2
    elif arch == "mistral":
        # Mistral 7B v0.1's window: longer than tiny's context, so it acts only when overridden.
        config["sliding_window"] = 4096
    else:
        config = _gemma3_config(config, shape)
    return config | (config_overrides or {})


def _gemma3_config(base: dict[str, Any], shape: ModelSize) -> dict[str, Any]:
    """Gemma 3's text config as transformers 5 writes it (Gemma3TextConfig), on `base`'s shape."""
    # Gemma 3 has its own keys for these: hidden_activation, rope_parameters.
    llama_keys = ("hidden_act", "rope_theta", "rope_scaling")
    config = {key: value for key, value in base.items() if key not in llama_keys}
    # Gemma 3's pattern, five sliding layers then a full one, cut to end in a full layer on models
    # of fewer than six layers (tiny's four), so that every size has both kinds.
    pattern = min(6, shape.num_layers)
    layer_types = [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(shape.num_layers)
    ]
    return config | {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        # q_norm and k_norm leave each head's query and key at unit RMS whatever the projections'
        # scale: this scalar is what gives attention scores their standard deviation of about two.
        "query_pre_attn_scalar": base["head_dim"] // 4,
        # Well inside the context, so that tests go past it.
        "sliding_window": shape.max_position_embeddings // 32,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": True,
        "pad_token_id": SPECIAL_TOKEN_IDS[ENDOFTEXT],
    }


def make_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint that transformers and the engine load offline; return its directory."""
    config = model_config(arch, size, config_overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(init_weights(config, seed), out / "model.safetensors", metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    generation_config = {
        "bos_token_id": SPECIAL_TOKEN_IDS[ENDOFTEXT],
        "eos_token_id": [SPECIAL_TOKEN_IDS[IM_END], SPECIAL_TOKEN_IDS[ENDOFTEXT]],
        "pad_token_id": SPECIAL_TOKEN_IDS[ENDOFTEXT],
    }
    _write_json(out / "generation_config.json", generation_config)
    # transformers normalises Qwen2 input to NFC whatever the file says: the file says so too.
    write_tokenizer(out, nfc=arch == "qwen2")
    return out


def init_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Float32 weights, named as transformers names them, for a config from `model_config`."""
    hidden = config["hidden_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    gemma = config["model_type"] == "gemma3_text"
    weights: dict[str, torch.Tensor] = {}

    def normal(name: str, shape: tuple[int, ...], std: float) -> None:
        weights[name] = torch.randn(shape, generator=_generator(seed, name)) * std

    def norm(name: str, size: int = hidden, scale: float = 1.0) -> None:
        """A norm whose scales are uniform in [scale - 0.5, scale + 0.5]. Gemma's norms scale by
        1 + weight, so its weights are drawn 1 lower, around 0 for the usual spread."""
        low = scale - 0.5 - (1.0 if gemma else 0.0)
        weights[name] = torch.rand(size, generator=_generator(seed, name)) + low

    embed_std = GEMMA_EMBED_RMS / hidden**0.5 if gemma else 1.0
    normal("model.embed_tokens.weight", (config["vocab_size"], hidden), embed_std)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        projections = {
            "self_attn.q_proj": (q_dim, hidden, QK_SCALE),
            "self_attn.k_proj": (kv_dim, hidden, QK_SCALE),
            "self_attn.v_proj": (kv_dim, hidden, 1.0),
            "self_attn.o_proj": (hidden, q_dim, O_SCALE),
            "mlp.gate_proj": (inter, hidden, 1.0),
            "mlp.up_proj": (inter, hidden, 1.0),
            "mlp.down_proj": (hidden, inter, MLP_SCALE),
        }
        for name, (rows, cols, scale) in projections.items():
            normal(f"{layer}{name}.weight", (rows, cols), scale / cols**0.5)
            if config["model_type"] == "qwen2" and name in QWEN2_BIASES:
                normal(f"{layer}{name}.bias", (rows,), BIAS_SCALE * scale)
        norm(f"{layer}input_layernorm.weight")
        if gemma:
            norm(f"{layer}post_attention_layernorm.weight", scale=GEMMA_SUBLAYER_SCALE)
            norm(f"{layer}pre_feedforward_layernorm.weight")
            norm(f"{layer}post_feedforward_layernorm.weight", scale=GEMMA_SUBLAYER_SCALE)
            norm(f"{layer}self_attn.q_norm.weight", head_dim)
            norm(f"{layer}self_attn.k_norm.weight", head_dim)
        else:
            norm(f"{layer}post_attention_layernorm.weight")
    if gemma:  # the LM head is the embedding, its rows of norm GEMMA_EMBED_RMS
        norm("model.norm.weight", scale=LM_HEAD_SCALE / GEMMA_EMBED_RMS)
    else:
        norm("model.norm.weight")
        normal("lm_head.weight", (config["vocab_size"], hidden), LM_HEAD_SCALE / hidden**0.5)
    return weights


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

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
  small embeddings (see GEMMA_EMBED_RMS); Gemma 2 likewise, less the query and key norms, its
  soft-caps low enough to act (see `_gemma2_config`); Qwen3 from its q/k norms' scales;
- the mixtures of experts (Mixtral, Qwen3-MoE) get routers whose logits spread as attention
  scores do, so that tokens of one prompt go to different experts.

Every tensor is drawn from its own generator, seeded from the model seed and the tensor's name:
the same arguments give the same bytes, and config overrides that keep a tensor's shape (a
sliding window, RoPE scaling) keep its values, so such variants differ from the base model only
where the override acts.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, processors

from pagedbatch.demo_tokenizer import (
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKEN_IDS,
    VOCAB_SIZE,
    chat_template,
    write_tokenizer,
)
from pagedbatch.moderation import CATEGORIES, GUARD_CODES

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
    "bert": "BertModel",
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


ROPE_SCALINGS = ("yarn", "llama3", "linear")
TASKS = ("generate", "classify", "guard", "embed")
CLASSIFIER_ARCHS = ("llama", "qwen2", "mistral")
# Decoders that --task embed makes embedding models of (without an LM head, last-token pooling).
EMBED_DECODER_ARCHS = {"llama": "LlamaModel", "qwen2": "Qwen2Model"}
# BERT's special tokens, after the demo tokenizer's own; sentences are encoded [CLS] ... [SEP].
BERT_TOKENS = ("[CLS]", "[SEP]", "[PAD]", "[MASK]")
BERT_MAX_POSITIONS = 512
# What sentence-transformers cuts inputs to, below the position table as all-MiniLM-L6-v2's is.
BERT_MAX_SEQ_LENGTH = 256
# The score head's spread: label logits of a few units, so that sigmoid scores span (0, 1)
# and move with the input.
SCORE_SCALE = 3.0


@dataclass(frozen=True)
class VisionSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    image_size: int  # pixels a side, after the processor's resize and crop


# LLaVA-1.5's tower reads 336-pixel images in 14-pixel patches: 576 image tokens.
VISION_SIZES = {
    "tiny": VisionSize(64, 3, 4, 256, 56),  # 16 image tokens
    "small": VisionSize(384, 6, 6, 1536, 336),  # 576 image tokens, as LLaVA-1.5's
    "medium": VisionSize(768, 12, 12, 3072, 336),
}
PATCH_SIZE = 14
IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = VOCAB_SIZE  # the first id after the demo tokenizer's own
# Qwen2-VL's vision tokens, after the demo tokenizer's own; an image is written as
# <|vision_start|><|image_pad|><|vision_end|>, the pad expanded to one per 2x2 patches.
QWEN2_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN2_VL_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
SPATIAL_MERGE = 2
TEMPORAL_PATCH = 2
# Qwen2-VL resizes an image, keeping its aspect ratio, to a multiple of 28 pixels a side and at
# most this many pixels: 448x448 (256 image tokens) for small, 112x112 (16) for tiny.
QWEN2_VL_MAX_PIXELS = {"tiny": 112 * 112, "small": 448 * 448, "medium": 448 * 448}
# CLIP's pixel statistics, which LLaVA's processor normalises with.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Qwen2-Audio's audio tokens, after the demo tokenizer's own; a clip is written as
# <|audio_bos|><|AUDIO|><|audio_eos|>, the middle one expanded to one per 40 ms of sound.
QWEN2_AUDIO_TOKENS = ("<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>")
QWEN2_AUDIO_PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
# A Whisper-style encoder: 128 log-mel bins of 16 kHz sound, 10 ms a frame, 30 s a window.
MEL_BINS = 128
SAMPLING_RATE = 16_000
AUDIO_FRAMES = 3000


@dataclass(frozen=True)
class AudioSize:
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int


AUDIO_SIZES = {
    "tiny": AudioSize(64, 2, 4, 256),
    "small": AudioSize(384, 4, 6, 1536),  # Whisper tiny's encoder width
    "medium": AudioSize(768, 12, 12, 3072),
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
# Router logits' standard deviation: each token's top experts are clear, and differ by token.
ROUTER_SCALE = 2.0
# Experts per layer and per token of the generated mixtures of experts.
NUM_EXPERTS = {"mixtral": 4, "qwen3_moe": 8}
EXPERTS_PER_TOKEN = 2
# Each checkpoint's names for a layer's experts, their router and their projections (gate, up,
# down), as the models on the Hub are saved.
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
GEMMA_TYPES = ("gemma3_text", "gemma2")
# Gemma 3 ties its LM head to its embeddings, so a token's embedding favours the token itself as
# the next one: where embeddings dominate the residual stream, greedy output cycles through a few
# tokens. They enter it at this RMS (after Gemma's sqrt(hidden) scaling), well below what the
# sublayers write; the final norm's scale then gives the logits their spread.
GEMMA_EMBED_RMS = 0.25


def long_context(size: str, max_position_embeddings: int, rope_type: str = "yarn") -> dict:
    """Config overrides for a context of `max_position_embeddings` tokens: past the size's own,
    RoPE scaled by `rope_type` (yarn, llama3 or linear) from the size's context."""
    if rope_type not in ROPE_SCALINGS:
        raise ValueError(f"rope scaling must be one of {ROPE_SCALINGS}, got {rope_type!r}")
    if max_position_embeddings < 1:
        raise ValueError(f"max_position_embeddings must be positive, got {max_position_embeddings}")
    original = SIZES[size].max_position_embeddings
    overrides: dict[str, Any] = {"max_position_embeddings": max_position_embeddings}
    if max_position_embeddings > original:
        factor = max_position_embeddings / original
        scaling: dict[str, Any] = {"rope_type": rope_type, "factor": factor}
        if rope_type != "linear":
            scaling["original_max_position_embeddings"] = original
        if rope_type == "llama3":
            scaling |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
        overrides["rope_scaling"] = scaling
    return overrides


def model_config(
    arch: str = "llama", size: str = "tiny", config_overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The config.json of a generated checkpoint, overrides merged in last."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if arch == "llava":
        return _llava_config(size) | (config_overrides or {})
    if arch == "bert":
        return _bert_config(size) | (config_overrides or {})
    if arch == "qwen2_vl":
        return _qwen2_vl_config(size) | (config_overrides or {})
    if arch == "qwen2_audio":
        return _qwen2_audio_config(size) | (config_overrides or {})
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
    elif arch in ("qwen3", "qwen3_moe"):
        # As Qwen2's window, off unless overridden; no q/k/v biases.
        config |= {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}
        config["max_window_layers"] = shape.num_layers // 2
        if arch == "qwen3_moe":
            # Experts of a third of the dense MLP, as Qwen3-30B-A3B's; top-k weights left as
            # the softmax gives them (norm_topk_prob false, transformers' default), where
            # Mixtral's are renormalised: the two routings between them.
            config |= {
                "num_experts": NUM_EXPERTS[arch],
                "num_experts_per_tok": EXPERTS_PER_TOKEN,
                "moe_intermediate_size": shape.intermediate_size // 3,
                "norm_topk_prob": False,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "router_aux_loss_coef": 0.001,
            }
    elif arch == "phi3":
        config |= {
            "original_max_position_embeddings": shape.max_position_embeddings,
            "sliding_window": None,
            "pad_token_id": SPECIAL_TOKEN_IDS[ENDOFTEXT],
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
        }
    elif arch == "mixtral":
        config |= {
            "sliding_window": None,
            "num_local_experts": NUM_EXPERTS[arch],
            "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "router_jitter_noise": 0.0,
            "router_aux_loss_coef": 0.001,
        }
    elif arch == "gemma2":
        config = _gemma2_config(config, shape)
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


def _gemma2_config(base: dict[str, Any], shape: ModelSize) -> dict[str, Any]:
    """Gemma 2's config as transformers 5 writes it (Gemma2Config), on `base`'s shape: Gemma 3's
    layer outline without q/k norms, sliding and full layers alternating, one RoPE, and both
    soft-caps. Gemma 2's cap on logits (30) acts on the tiny model's top logits (about 20, 17
    once capped) and keeps the top two apart (a cap of 10 made a tenth of them near-ties); its
    cap on attention scores (50) would barely touch scores of a standard deviation of about
    three: 5 here."""
    gemma3 = _gemma3_config(base, shape)
    drop = ("use_bidirectional_attention", "rope_parameters")
    config = {key: value for key, value in gemma3.items() if key not in drop}
    return config | {
        "model_type": "gemma2",
        # Without q/k norms the projections' scale sets the scores; this makes it felt.
        "query_pre_attn_scalar": base["head_dim"] // 2,
        "layer_types": [
            "sliding_attention" if (i + 1) % 2 else "full_attention"
            for i in range(shape.num_layers)
        ],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 30.0,
    }


def _text_config(arch: str, size: str, extra_tokens: int) -> dict[str, Any]:
    """A multimodal model's language model config: `arch`'s, its vocabulary grown by the
    `extra_tokens` placeholders that follow the demo tokenizer's own."""
    text = model_config(arch, size) | {"vocab_size": VOCAB_SIZE + extra_tokens}
    del text["architectures"]  # the outer config names the model
    return text


def _llava_config(size: str) -> dict[str, Any]:
    """LLaVA-1.5's config as transformers 5 writes it: a CLIP vision tower, a two-layer
    projector and a Llama whose vocabulary ends in the image token."""
    text = _text_config("llama", size, 1)
    vision = VISION_SIZES[size]
    return {
        "architectures": [ARCHITECTURES["llava"]],
        "model_type": "llava",
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size,
            "num_hidden_layers": vision.num_layers,
            "num_attention_heads": vision.num_heads,
            "image_size": vision.image_size,
            "patch_size": PATCH_SIZE,
            "num_channels": 3,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "attention_dropout": 0.0,
            "projection_dim": vision.hidden_size,
        },
        "image_token_index": IMAGE_TOKEN_ID,
        "image_seq_length": (vision.image_size // PATCH_SIZE) ** 2,
        "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "multimodal_projector_bias": True,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def _qwen2_vl_config(size: str) -> dict[str, Any]:
    """Qwen2-VL's config as transformers 5 writes it: a ViT with 2-D rotary embeddings and a
    2x2 patch merger, and a Qwen2 whose rotary embedding is M-RoPE (positions along time,
    height and width, in sections of each head's frequencies)."""
    text = _text_config("qwen2", size, len(QWEN2_VL_TOKENS))
    for key in ("rope_theta", "rope_scaling", "max_window_layers"):  # Qwen2-VL's own keys below
        del text[key]
    half = text["head_dim"] // 2
    # Qwen2-VL's split of 64 frequencies, [16, 24, 24], scaled to this head size.
    temporal = half // 4
    text |= {
        "model_type": "qwen2_vl_text",
        "layer_types": ["full_attention"] * text["num_hidden_layers"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [
                temporal,
                (half - temporal) // 2,
                half - temporal - (half - temporal) // 2,
            ],
        },
    }
    vision = VISION_SIZES[size]
    token_ids = {token: VOCAB_SIZE + i for i, token in enumerate(QWEN2_VL_TOKENS)}
    return {
        "architectures": [ARCHITECTURES["qwen2_vl"]],
        "model_type": "qwen2_vl",
        "text_config": text,
        "vision_config": {
            "model_type": "qwen2_vl_vision",
            "depth": vision.num_layers,
            "embed_dim": vision.hidden_size,
            "hidden_size": text["hidden_size"],
            "hidden_act": "quick_gelu",
            "mlp_ratio": vision.intermediate_size // vision.hidden_size,
            "num_heads": vision.num_heads,
            "in_channels": 3,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": SPATIAL_MERGE,
            "temporal_patch_size": TEMPORAL_PATCH,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        },
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def _qwen2_audio_config(size: str) -> dict[str, Any]:
    """Qwen2-Audio's config as transformers 5 writes it: a Whisper-style encoder (two
    convolutions, sinusoidal positions, pre-norm layers, 2x average pooling), a linear projector
    and a Qwen2 whose vocabulary ends in the audio tokens."""
    text = _text_config("qwen2", size, len(QWEN2_AUDIO_TOKENS))
    audio = AUDIO_SIZES[size]
    return {
        "architectures": [ARCHITECTURES["qwen2_audio"]],
        "model_type": "qwen2_audio",
        "text_config": text,
        "audio_config": {
            "model_type": "qwen2_audio_encoder",
            "num_mel_bins": MEL_BINS,
            "d_model": audio.d_model,
            "encoder_layers": audio.num_layers,
            "encoder_attention_heads": audio.num_heads,
            "encoder_ffn_dim": audio.ffn_dim,
            "activation_function": "gelu",
            "max_source_positions": AUDIO_FRAMES // 2,
            "scale_embedding": False,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
            "encoder_layerdrop": 0.0,
        },
        "audio_token_index": VOCAB_SIZE + QWEN2_AUDIO_TOKENS.index("<|AUDIO|>"),
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


# A Llama-Guard-shaped chat template: the conversation and the hazard categories in, "safe" or
# "unsafe" and the violated codes out, as Llama Guard 3's template asks of its model.
GUARD_TEMPLATE = (
    "{%- set role = 'Agent' if messages[-1]['role'] == 'assistant' else 'User' -%}"
    "<|im_start|>user\nTask: Check if there is unsafe content in '{{ role }}' messages in "
    "conversations according to our safety policy with the below categories.\n\n"
    "<BEGIN UNSAFE CONTENT CATEGORIES>\n"
    + "".join(f"{code}: {name}.\n" for code, (name, _) in GUARD_CODES.items())
    + "<END UNSAFE CONTENT CATEGORIES>\n\n<BEGIN CONVERSATION>\n\n"
    "{%- for message in messages %}\n\n"
    "{{ 'User' if message['role'] == 'user' else 'Agent' }}: {{ message['content'] }}"
    "{%- endfor %}\n\n<END CONVERSATION>\n\n"
    "Provide your safety assessment for ONLY THE LAST {{ role }} message in the above "
    "conversation:\n - First line must read 'safe' or 'unsafe'.\n - If unsafe, a second line "
    "must include a comma-separated list of violated categories.<|im_end|>\n"
    # An expression, not text: Jinja drops a template's last newline.
    "<|im_start|>assistant{{ '\\n' }}"
)


def classifier_config(config: dict[str, Any]) -> dict[str, Any]:
    """A language model's config made a multi-label sequence classifier's, its labels OpenAI's
    moderation categories: transformers' `*ForSequenceClassification` reads the score head at
    the last token that is not padding."""
    labels = dict(enumerate(CATEGORIES))
    architecture = config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    return config | {
        "architectures": [architecture],
        "id2label": {str(i): label for i, label in labels.items()},
        "label2id": {label: i for i, label in labels.items()},
        "problem_type": "multi_label_classification",
        "pad_token_id": SPECIAL_TOKEN_IDS[ENDOFTEXT],
    }


def make_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
    task: str = "generate",
) -> Path:
    """Write a checkpoint that transformers and the engine load offline; return its directory.
    `task` "classify" makes it a moderation classifier, "guard" a Llama-Guard-shaped moderation
    model (both: llama, qwen2 and mistral), "embed" an embedding model in sentence-transformers'
    layout (llama and qwen2; bert is always one)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if arch == "bert" or task == "embed":
        return _make_embedding_model(Path(out_dir), arch, size, seed, config_overrides, task)
    if task != "generate" and arch not in CLASSIFIER_ARCHS:
        raise ValueError(f"a moderation model's arch is one of {CLASSIFIER_ARCHS}, got {arch!r}")
    config = model_config(arch, size, config_overrides)
    if task == "classify":
        config = classifier_config(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if arch == "llava":
        weights = init_llava_weights(config, seed)
    elif arch == "qwen2_vl":
        weights = init_qwen2_vl_weights(config, seed)
    elif arch == "qwen2_audio":
        weights = init_qwen2_audio_weights(config, seed)
    else:
        weights = init_weights(config, seed)
    if task == "classify":
        hidden = config["hidden_size"]
        del weights["lm_head.weight"]
        score = torch.randn((len(CATEGORIES), hidden), generator=_generator(seed, "score"))
        weights["score.weight"] = score * SCORE_SCALE / hidden**0.5
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    generation_config = {
        "bos_token_id": SPECIAL_TOKEN_IDS[ENDOFTEXT],
        "eos_token_id": [SPECIAL_TOKEN_IDS[IM_END], SPECIAL_TOKEN_IDS[ENDOFTEXT]],
        "pad_token_id": SPECIAL_TOKEN_IDS[ENDOFTEXT],
    }
    _write_json(out / "generation_config.json", generation_config)
    if arch == "llava":
        _write_llava_processor(out, config)
    elif arch == "qwen2_vl":
        _write_qwen2_vl_processor(out, size)
    elif arch == "qwen2_audio":
        _write_qwen2_audio_processor(out)
    else:
        # transformers normalises Qwen2 input to NFC whatever the file says: the file says so too.
        template = GUARD_TEMPLATE if task == "guard" else ""
        write_tokenizer(out, nfc=arch == "qwen2", template=template)
    return out


def _bert_config(size: str) -> dict[str, Any]:
    """BERT's config as transformers writes BertModel's, on the size's shape; its vocabulary
    the demo tokenizer's and BERT's special tokens."""
    shape = SIZES[size]
    return {
        "architectures": [ARCHITECTURES["bert"]],
        "model_type": "bert",
        "vocab_size": VOCAB_SIZE + len(BERT_TOKENS),
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": BERT_MAX_POSITIONS,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": VOCAB_SIZE + BERT_TOKENS.index("[PAD]"),
        "position_embedding_type": "absolute",
        "dtype": "float32",
    }


def init_bert_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """BertModel's tensors, named as transformers saves them, scaled as the vision towers' are
    (see `init_llava_weights`): attention sharp enough that each token's vector depends on its
    context, and random LayerNorm scales and biases, which an engine that skips them misses."""
    weights: dict[str, torch.Tensor] = {}
    draw = _VisionWeights(weights, seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    draw.normal("embeddings.word_embeddings.weight", (config["vocab_size"], hidden), 1.0)
    positions = (config["max_position_embeddings"], hidden)
    draw.normal("embeddings.position_embeddings.weight", positions, 0.5)
    draw.normal("embeddings.token_type_embeddings.weight", (config["type_vocab_size"], hidden), 0.5)
    draw.layer_norm("embeddings.LayerNorm", hidden)
    for i in range(config["num_hidden_layers"]):
        layer = f"encoder.layer.{i}."
        draw.linear(f"{layer}attention.self.query", hidden, hidden, QK_SCALE)
        draw.linear(f"{layer}attention.self.key", hidden, hidden, QK_SCALE)
        draw.linear(f"{layer}attention.self.value", hidden, hidden)
        draw.linear(f"{layer}attention.output.dense", hidden, hidden, O_SCALE)
        draw.layer_norm(f"{layer}attention.output.LayerNorm", hidden)
        draw.linear(f"{layer}intermediate.dense", inter, hidden)
        # GELU passes about half of a unit-RMS input's energy: twice the usual scale restores it.
        draw.linear(f"{layer}output.dense", hidden, inter, 2.0)
        draw.layer_norm(f"{layer}output.LayerNorm", hidden)
    draw.linear("pooler.dense", hidden, hidden)  # BertModel's; sentence-transformers skips it
    return weights


def _make_embedding_model(
    out: Path,
    arch: str,
    size: str,
    seed: int,
    config_overrides: dict[str, Any] | None,
    task: str,
) -> Path:
    """A BERT with mean pooling, or a decoder without its LM head with last-token pooling and
    Matryoshka dimensions, both normalized, in sentence-transformers' layout (modules.json,
    1_Pooling, 2_Normalize, sentence_bert_config.json): SentenceTransformer(out) loads it."""
    if arch != "bert" and arch not in EMBED_DECODER_ARCHS:
        archs = ", ".join(["bert", *EMBED_DECODER_ARCHS])
        raise ValueError(f"an embedding model's arch is one of {archs}, got {arch!r}")
    if arch == "bert" and task not in ("generate", "embed"):
        raise ValueError(f"bert makes an embedding model only, not task {task!r}")
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(arch, size, config_overrides)
    hidden = config["hidden_size"]
    if arch == "bert":
        weights = init_bert_weights(config, seed)
        _write_bert_tokenizer(out)
        pooling, max_seq_length = "pooling_mode_mean_tokens", BERT_MAX_SEQ_LENGTH
    else:
        config["architectures"] = [EMBED_DECODER_ARCHS[arch]]
        config["matryoshka_dimensions"] = [hidden, hidden // 2, hidden // 4]
        weights = init_weights(config, seed)
        del weights["lm_head.weight"]
        write_tokenizer(out, nfc=arch == "qwen2")
        pooling, max_seq_length = "pooling_mode_lasttoken", config["max_position_embeddings"]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    _write_json(
        out / "modules.json",
        [
            {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
            for i, (kind, path) in enumerate(modules)
        ],
    )
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    flags = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens")
    flags += ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
    flags += ("pooling_mode_lasttoken",)
    pooling_config = {"word_embedding_dimension": hidden}
    pooling_config |= {flag: flag == pooling for flag in flags} | {"include_prompt": True}
    _write_json(out / "1_Pooling" / "config.json", pooling_config)
    _write_json(
        out / "sentence_bert_config.json",
        {"max_seq_length": max_seq_length, "do_lower_case": False},
    )
    return out


def _write_bert_tokenizer(out: Path) -> None:
    """The demo tokenizer with BERT's special tokens, which it wraps every text in:
    [CLS] text [SEP] (and [CLS] a [SEP] b [SEP] for a pair), as BERT's own tokenizer does."""
    write_tokenizer(out, extra_special=BERT_TOKENS)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {token: VOCAB_SIZE + i for i, token in enumerate(BERT_TOKENS)}
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "mask_token": "[MASK]",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": BERT_MAX_SEQ_LENGTH,
    }
    _write_json(out / "tokenizer_config.json", config)


def _write_llava_processor(out: Path, config: dict[str, Any]) -> None:
    """The tokenizer with its image token, and what AutoProcessor reads: the image processor
    (resize, crop, CLIP's normalisation) and the processor, which expands each image token of
    the chat template's text into one per patch."""
    template = chat_template(IMAGE_TOKEN)
    write_tokenizer(out, extra_special=(IMAGE_TOKEN,), template=template)
    side = config["vision_config"]["image_size"]
    _write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "do_resize": True,
            "size": {"shortest_edge": side},
            "resample": 3,
            "do_center_crop": True,
            "crop_size": {"height": side, "width": side},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
        },
    )
    _write_json(
        out / "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "patch_size": PATCH_SIZE,
            "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1,  # CLIP's class token, which "default" drops
            "image_token": IMAGE_TOKEN,
        },
    )
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")


def _write_qwen2_vl_processor(out: Path, size: str) -> None:
    """The tokenizer with the vision tokens, and what AutoProcessor reads: Qwen2-VL's image
    processor (resize to a multiple of 28 pixels within a pixel budget, 14x14x2 patches) and the
    processor, which expands each <|image_pad|> into one per merged patch."""
    template = chat_template(QWEN2_VL_PLACEHOLDER)
    write_tokenizer(out, nfc=True, extra_special=QWEN2_VL_TOKENS, template=template)
    _write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "do_resize": True,
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
            "min_pixels": 56 * 56,
            "max_pixels": QWEN2_VL_MAX_PIXELS[size],
            "patch_size": PATCH_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH,
            "merge_size": SPATIAL_MERGE,
        },
    )
    _write_json(out / "processor_config.json", {"processor_class": "Qwen2VLProcessor"})
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")


def _write_qwen2_audio_processor(out: Path) -> None:
    """The tokenizer with the audio tokens, and what AutoProcessor reads: Whisper's feature
    extractor (128 log-mel bins, a 30 s window) and the processor, which expands each <|AUDIO|>
    into one per 40 ms of the clip."""
    template = chat_template(audio_placeholder=QWEN2_AUDIO_PLACEHOLDER)
    write_tokenizer(out, nfc=True, extra_special=QWEN2_AUDIO_TOKENS, template=template)
    _write_json(
        out / "preprocessor_config.json",
        {
            "feature_extractor_type": "WhisperFeatureExtractor",
            "feature_size": MEL_BINS,
            "sampling_rate": SAMPLING_RATE,
            "hop_length": 160,
            "chunk_length": AUDIO_FRAMES // 100,
            "n_fft": 400,
            "n_samples": AUDIO_FRAMES * 160,
            "nb_max_frames": AUDIO_FRAMES,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": True,
            "processor_class": "Qwen2AudioProcessor",
        },
    )
    _write_json(
        out / "processor_config.json",
        {
            "processor_class": "Qwen2AudioProcessor",
            "audio_token": "<|AUDIO|>",
            "audio_bos_token": "<|audio_bos|>",
            "audio_eos_token": "<|audio_eos|>",
        },
    )
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")


def init_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Float32 weights, named as transformers names them, for a config from `model_config`."""
    hidden = config["hidden_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    model_type = config["model_type"]
    gemma = model_type in GEMMA_TYPES
    experts = EXPERT_NAMES.get(model_type)
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
        }
        if experts is None:
            projections |= {
                "mlp.gate_proj": (inter, hidden, 1.0),
                "mlp.up_proj": (inter, hidden, 1.0),
                "mlp.down_proj": (hidden, inter, MLP_SCALE),
            }
        else:
            block, (gate, up, down) = experts
            expert_inter = config.get("moe_intermediate_size", inter)
            num_experts = config.get("num_experts") or config["num_local_experts"]
            projections[f"{block}.gate"] = (num_experts, hidden, ROUTER_SCALE)
            for e in range(num_experts):
                projections |= {
                    f"{block}.experts.{e}.{gate}": (expert_inter, hidden, 1.0),
                    f"{block}.experts.{e}.{up}": (expert_inter, hidden, 1.0),
                    f"{block}.experts.{e}.{down}": (hidden, expert_inter, MLP_SCALE),
                }
        for name, (rows, cols, scale) in projections.items():
            normal(f"{layer}{name}.weight", (rows, cols), scale / cols**0.5)
            if model_type in ("qwen2", "qwen2_vl_text") and name in QWEN2_BIASES:
                normal(f"{layer}{name}.bias", (rows,), BIAS_SCALE * scale)
        norm(f"{layer}input_layernorm.weight")
        if gemma:
            norm(f"{layer}post_attention_layernorm.weight", scale=GEMMA_SUBLAYER_SCALE)
            norm(f"{layer}pre_feedforward_layernorm.weight")
            norm(f"{layer}post_feedforward_layernorm.weight", scale=GEMMA_SUBLAYER_SCALE)
        else:
            norm(f"{layer}post_attention_layernorm.weight")
        if model_type == "gemma3_text":
            norm(f"{layer}self_attn.q_norm.weight", head_dim)
            norm(f"{layer}self_attn.k_norm.weight", head_dim)
        elif model_type in ("qwen3", "qwen3_moe"):
            # Queries and keys of unit RMS, scaled as the projections scale the others' (QK_SCALE).
            norm(f"{layer}self_attn.q_norm.weight", head_dim, scale=QK_SCALE)
            norm(f"{layer}self_attn.k_norm.weight", head_dim, scale=QK_SCALE)
        if model_type == "phi3":  # its q/k/v and its gate/up are one tensor each
            attn, mlp = f"{layer}self_attn.", f"{layer}mlp."
            weights[f"{attn}qkv_proj.weight"] = torch.cat(
                [weights.pop(f"{attn}{p}_proj.weight") for p in "qkv"]
            )
            weights[f"{mlp}gate_up_proj.weight"] = torch.cat(
                [weights.pop(f"{mlp}{p}_proj.weight") for p in ("gate", "up")]
            )
    if gemma:  # the LM head is the embedding, its rows of norm GEMMA_EMBED_RMS
        norm("model.norm.weight", scale=LM_HEAD_SCALE / GEMMA_EMBED_RMS)
    else:
        norm("model.norm.weight")
        normal("lm_head.weight", (config["vocab_size"], hidden), LM_HEAD_SCALE / hidden**0.5)
    return weights


class _VisionWeights:
    """A vision tower's tensors, each drawn from its own generator (see the module docstring)
    into `weights`."""

    def __init__(self, weights: dict[str, torch.Tensor], seed: int):
        self.weights = weights
        self.seed = seed

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> None:
        self.weights[name] = torch.randn(shape, generator=_generator(self.seed, name)) * std

    def layer_norm(self, name: str, size: int) -> None:
        """Scales uniform in [0.5, 1.5) and small biases."""
        generator = _generator(self.seed, name)
        self.weights[f"{name}.weight"] = torch.rand(size, generator=generator) + 0.5
        self.normal(f"{name}.bias", (size,), BIAS_SCALE)

    def linear(self, name: str, rows: int, cols: int, scale: float = 1.0) -> None:
        """Outputs of about `scale` RMS for unit-RMS inputs, plus small biases."""
        self.normal(f"{name}.weight", (rows, cols), scale / cols**0.5)
        self.normal(f"{name}.bias", (rows,), BIAS_SCALE)


def init_llava_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The Llama's weights (as `init_weights`) and the vision tower's and projector's, named as
    transformers saves LLaVA. Patch and position embeddings and the projector are scaled so
    that image tokens reach the language model at the token embeddings' RMS, each carrying
    its own patch: change one patch and the continuation changes."""
    weights = {
        f"language_model.{name}": tensor
        for name, tensor in init_weights(config["text_config"], seed).items()
    }
    vision = config["vision_config"]
    hidden, inter = vision["hidden_size"], vision["intermediate_size"]
    patch = vision["patch_size"]
    patch_inputs = vision["num_channels"] * patch * patch
    num_positions = (vision["image_size"] // patch) ** 2 + 1
    draw = _VisionWeights(weights, seed)
    tower = "vision_tower."
    draw.normal(f"{tower}embeddings.class_embedding", (hidden,), 1.0)
    draw.normal(
        f"{tower}embeddings.patch_embedding.weight",
        (hidden, vision["num_channels"], patch, patch),
        1.0 / patch_inputs**0.5,
    )
    draw.normal(f"{tower}embeddings.position_embedding.weight", (num_positions, hidden), 0.5)
    draw.layer_norm(f"{tower}pre_layrnorm", hidden)
    for i in range(vision["num_hidden_layers"]):
        layer = f"{tower}encoder.layers.{i}."
        draw.linear(f"{layer}self_attn.q_proj", hidden, hidden, QK_SCALE)
        draw.linear(f"{layer}self_attn.k_proj", hidden, hidden, QK_SCALE)
        draw.linear(f"{layer}self_attn.v_proj", hidden, hidden)
        draw.linear(f"{layer}self_attn.out_proj", hidden, hidden)
        draw.linear(f"{layer}mlp.fc1", inter, hidden)
        draw.linear(f"{layer}mlp.fc2", hidden, inter)
        draw.layer_norm(f"{layer}layer_norm1", hidden)
        draw.layer_norm(f"{layer}layer_norm2", hidden)
    draw.layer_norm(f"{tower}post_layernorm", hidden)
    text_hidden = config["text_config"]["hidden_size"]
    draw.linear("multi_modal_projector.linear_1", text_hidden, hidden)
    # GELU passes about half of a unit-RMS input's energy: twice the usual scale restores it.
    draw.linear("multi_modal_projector.linear_2", text_hidden, text_hidden, 2.0)
    return weights


def init_qwen2_vl_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The Qwen2's weights (as `init_weights`) and the vision tower's and merger's, named as
    transformers saves Qwen2-VL, scaled as LLaVA's are (see `init_llava_weights`)."""
    weights = init_weights(config["text_config"], seed)
    vision = config["vision_config"]
    dim = vision["embed_dim"]
    inter = dim * vision["mlp_ratio"]
    patch = vision["patch_size"]
    patch_shape = (vision["in_channels"], vision["temporal_patch_size"], patch, patch)
    patch_inputs = patch_shape[0] * patch_shape[1] * patch * patch
    merged = dim * vision["spatial_merge_size"] ** 2
    draw = _VisionWeights(weights, seed)
    draw.normal("visual.patch_embed.proj.weight", (dim, *patch_shape), 1.0 / patch_inputs**0.5)
    for i in range(vision["depth"]):
        block = f"visual.blocks.{i}."
        draw.layer_norm(f"{block}norm1", dim)
        draw.layer_norm(f"{block}norm2", dim)
        # q, k and v in one: q and k scaled for sharp attention, as the text model's.
        draw.linear(f"{block}attn.qkv", 3 * dim, dim)
        weights[f"{block}attn.qkv.weight"][: 2 * dim] *= QK_SCALE
        draw.linear(f"{block}attn.proj", dim, dim)
        draw.linear(f"{block}mlp.fc1", inter, dim)
        draw.linear(f"{block}mlp.fc2", dim, inter)
    draw.layer_norm("visual.merger.ln_q", dim)
    draw.linear("visual.merger.mlp.0", merged, merged)
    # GELU passes about half of a unit-RMS input's energy: twice the usual scale restores it.
    draw.linear("visual.merger.mlp.2", config["text_config"]["hidden_size"], merged, 2.0)
    return weights


def init_qwen2_audio_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The Qwen2's weights (as `init_weights`) and the audio encoder's and projector's, named as
    transformers saves Qwen2-Audio. Positions are Whisper's sinusoids; the convolutions, layers
    and projector are scaled as the vision towers' are, so that what the model hears reaches
    the language model at the token embeddings' RMS: a different tone, a different answer."""
    weights = {
        f"language_model.{name}": tensor
        for name, tensor in init_weights(config["text_config"], seed).items()
    }
    audio = config["audio_config"]
    dim, ffn, mels = audio["d_model"], audio["encoder_ffn_dim"], audio["num_mel_bins"]
    draw = _VisionWeights(weights, seed)
    tower = "audio_tower."
    # GELU follows each convolution: twice the usual scale keeps unit RMS.
    draw.normal(f"{tower}conv1.weight", (dim, mels, 3), 2.0 / (mels * 3) ** 0.5)
    draw.normal(f"{tower}conv1.bias", (dim,), BIAS_SCALE)
    draw.normal(f"{tower}conv2.weight", (dim, dim, 3), 2.0 / (dim * 3) ** 0.5)
    draw.normal(f"{tower}conv2.bias", (dim,), BIAS_SCALE)
    weights[f"{tower}embed_positions.weight"] = _sinusoids(audio["max_source_positions"], dim)
    for i in range(audio["encoder_layers"]):
        layer = f"{tower}layers.{i}."
        draw.linear(f"{layer}self_attn.q_proj", dim, dim, QK_SCALE)
        # Whisper's key projection has no bias.
        draw.normal(f"{layer}self_attn.k_proj.weight", (dim, dim), QK_SCALE / dim**0.5)
        draw.linear(f"{layer}self_attn.v_proj", dim, dim)
        draw.linear(f"{layer}self_attn.out_proj", dim, dim)
        draw.linear(f"{layer}fc1", ffn, dim)
        draw.linear(f"{layer}fc2", dim, ffn, 2.0)
        draw.layer_norm(f"{layer}self_attn_layer_norm", dim)
        draw.layer_norm(f"{layer}final_layer_norm", dim)
    draw.layer_norm(f"{tower}layer_norm", dim)
    draw.linear("multi_modal_projector.linear", config["text_config"]["hidden_size"], dim)
    return weights


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's position embeddings: sines then cosines of geometric timescales."""
    increment = math.log(10_000) / (channels // 2 - 1)
    inverse = torch.exp(-increment * torch.arange(channels // 2, dtype=torch.float32))
    scaled = torch.arange(length, dtype=torch.float32)[:, None] * inverse[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

"""What `make_model` promises: loadable, deterministic checkpoints whose output depends on context.

The engine's correctness oracle is greedy equality with transformers on these checkpoints, so the
context-sensitivity tests below are what let engine tests catch position, caching and preemption
bugs: a model that ignored its prompt would hide them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
)

from pagedbatch import cli
from pagedbatch.demo_tokenizer import ENDOFTEXT, IM_END, IM_START, SPECIAL_TOKEN_IDS, tokenizer_json
from pagedbatch.make_model import ARCHITECTURES, long_context, make_model, model_config
from pagedbatch.moderation import CATEGORIES, GUARD_CODES

# The text models
ARCHS = ("llama", "qwen2", "mistral", "gemma3", "qwen3", "phi3", "gemma2", "mixtral", "qwen3_moe")
MakeCheckpoint = Callable[..., Path]
FIRST_SPECIAL_ID = min(SPECIAL_TOKEN_IDS.values())


def _param_count_from_config(config: dict[str, Any]) -> int:
    config = dict(config)
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, FIRST_SPECIAL_ID, (length,), generator=generator).tolist()


def _with_token_changed(prompt: list[int], position: int) -> list[int]:
    changed = list(prompt)
    changed[position] = (changed[position] + 1000) % FIRST_SPECIAL_ID
    return changed


def _greedy(model: PreTrainedModel, prompt: list[int], max_tokens: int) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,  # no early stop on an end-of-sequence token
        do_sample=False,
    )
    return output[0, len(prompt) :].tolist()


def _file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


@pytest.fixture(scope="module", params=ARCHS)
def tiny_model(request: pytest.FixtureRequest, make_checkpoint: MakeCheckpoint) -> PreTrainedModel:
    path = make_checkpoint(request.param)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# The checkpoint on disk


def test_checkpoint_holds_config_weights_generation_config_and_tokenizer(tiny_llama: Path) -> None:
    assert {p.name for p in tiny_llama.iterdir()} == {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    weights = load_file(tiny_llama / "model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}


@pytest.mark.parametrize(
    "arch, architecture",
    [
        ("llama", "LlamaForCausalLM"),
        ("qwen2", "Qwen2ForCausalLM"),
        ("mistral", "MistralForCausalLM"),
    ],
)
def test_config_names_the_architecture_and_a_gqa_shape(arch: str, architecture: str) -> None:
    config = model_config(arch, "tiny")
    assert config["architectures"] == [architecture]
    assert config["model_type"] == arch
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["vocab_size"] == 16384
    assert config["max_position_embeddings"] == 2048
    assert config["rope_theta"] == 10000.0
    assert config["rms_norm_eps"] == 1e-6
    assert config["num_key_value_heads"] < config["num_attention_heads"]


@pytest.mark.parametrize("size", ["tiny", "small", "medium"])
def test_gemma3_config_is_a_gemma3_text_config_with_both_layer_kinds(size: str) -> None:
    config = model_config("gemma3", size)
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    assert config["tie_word_embeddings"] is True
    assert {"sliding_attention", "full_attention"} == set(config["layer_types"])
    assert config["sliding_window"] < config["max_position_embeddings"] // 8
    hf_config = AutoConfig.for_model(**config)
    assert hf_config.layer_types == config["layer_types"]
    assert hf_config.rope_parameters == config["rope_parameters"]
    assert "hidden_act" not in config and "rope_theta" not in config


def test_gemma3_has_its_norms_and_no_lm_head_of_its_own(make_checkpoint: MakeCheckpoint) -> None:
    names = load_file(make_checkpoint("gemma3") / "model.safetensors")
    layer = {name.removeprefix("model.layers.0.") for name in names if ".layers.0." in name}
    assert {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    } <= layer
    assert "lm_head.weight" not in names
    # Gemma's norms scale by 1 + weight: drawn around 0, so that the scales spread around 1.
    weight = names["model.layers.0.input_layernorm.weight"]
    assert weight.min() >= -0.5 and weight.max() <= 0.5


def test_the_cli_offers_every_architecture() -> None:
    assert set(cli.ARCHS) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch, size", [("gpt2", "tiny"), ("llama", "huge")])
def test_unknown_architectures_and_sizes_are_refused(arch: str, size: str) -> None:
    with pytest.raises(ValueError, match="must be one of"):
        model_config(arch, size)


def test_small_and_medium_have_a_longer_context() -> None:
    assert model_config("llama", "small")["max_position_embeddings"] == 4096
    assert model_config("llama", "medium")["max_position_embeddings"] == 4096


def test_mistral_has_a_sliding_window_and_qwen2_has_qkv_biases(
    tiny_llama: Path, tiny_qwen2: Path, tiny_mistral: Path
) -> None:
    assert json.loads((tiny_mistral / "config.json").read_text())["sliding_window"] == 4096

    def biases(path: Path) -> set[str]:
        names = load_file(path / "model.safetensors")
        return {name.split(".")[-2] for name in names if name.endswith(".bias")}

    assert biases(tiny_qwen2) == {"q_proj", "k_proj", "v_proj"}
    assert biases(tiny_llama) == biases(tiny_mistral) == set()


@pytest.mark.parametrize("rope_type", ["yarn", "llama3", "linear"])
def test_a_longer_context_scales_rope_from_the_sizes_own(tmp_path: Path, rope_type: str) -> None:
    args = ["make-model", "--max-position-embeddings", "131072", "--rope-scaling", rope_type]
    assert cli.main([*args, str(tmp_path)]) == 0
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.max_position_embeddings == 131072
    rope = config.rope_parameters
    assert (rope["rope_type"], rope["factor"]) == (rope_type, 64.0)
    if rope_type != "linear":
        assert rope["original_max_position_embeddings"] == 2048
    # Within the size's own context, nothing is scaled; no context is empty.
    assert "rope_scaling" not in long_context("tiny", 1024)
    with pytest.raises(SystemExit, match="must be positive"):
        cli.main(["make-model", "--max-position-embeddings", "0", str(tmp_path / "none")])


def test_config_overrides_are_merged_last(make_checkpoint: MakeCheckpoint) -> None:
    rope_scaling = {"rope_type": "linear", "factor": 2.0}
    path = make_checkpoint("llama", rope_scaling=rope_scaling, max_position_embeddings=4096)
    config = json.loads((path / "config.json").read_text())
    assert config["rope_scaling"] == rope_scaling
    assert config["max_position_embeddings"] == 4096
    assert AutoConfig.from_pretrained(path).rope_parameters["rope_type"] == "linear"


def test_overrides_that_keep_the_shapes_keep_the_weights(
    tiny_mistral: Path, make_checkpoint: MakeCheckpoint
) -> None:
    windowed = make_checkpoint("mistral", sliding_window=16)
    assert (windowed / "model.safetensors").read_bytes() == (
        tiny_mistral / "model.safetensors"
    ).read_bytes()


def test_same_arguments_give_byte_identical_files(tmp_path: Path) -> None:
    first = _file_hashes(make_model(tmp_path / "first", arch="qwen2", seed=3))
    second = _file_hashes(make_model(tmp_path / "second", arch="qwen2", seed=3))
    other_seed = _file_hashes(make_model(tmp_path / "other", arch="qwen2", seed=4))
    assert first == second
    assert other_seed["model.safetensors"] != first["model.safetensors"]
    assert other_seed["tokenizer.json"] == first["tokenizer.json"]


def test_tokenizer_training_does_not_depend_on_the_process_or_thread_count() -> None:
    build = "import sys, pagedbatch.demo_tokenizer as t; sys.stdout.write(t.tokenizer_json())"
    env = os.environ | {"RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "1"}
    rebuilt = subprocess.run(
        [sys.executable, "-c", build], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert rebuilt == tokenizer_json()


@pytest.mark.parametrize(
    "size, low, high", [("tiny", 2e6, 10e6), ("small", 80e6, 130e6), ("medium", 450e6, 600e6)]
)
def test_parameter_counts(size: str, low: float, high: float) -> None:
    assert low <= _param_count_from_config(model_config("llama", size)) <= high


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_weight(arch: str, make_checkpoint: MakeCheckpoint) -> None:
    _, info = AutoModelForCausalLM.from_pretrained(
        make_checkpoint(arch), dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_classifier_scores_the_moderation_categories(arch: str, tmp_path: Path) -> None:
    assert cli.main(["make-model", "--arch", arch, "--task", "classify", str(tmp_path)]) == 0
    model, info = AutoModelForSequenceClassification.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
    family = ARCHITECTURES[arch].removesuffix("ForCausalLM")
    assert type(model).__name__ == f"{family}ForSequenceClassification"
    assert list(model.config.id2label.values()) == list(CATEGORIES)
    assert model.config.problem_type == "multi_label_classification"


def test_a_guard_renders_the_conversation_and_the_hazard_codes(tmp_path: Path) -> None:
    assert cli.main(["make-model", "--task", "guard", str(tmp_path)]) == 0
    _, info = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == info["unexpected_keys"] == set()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    conversation = [{"role": "user", "content": "How do I bake bread?"}]
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert "User: How do I bake bread?" in prompt
    assert all(f"{code}: {name}." in prompt for code, (name, _) in GUARD_CODES.items())
    assert "ONLY THE LAST User message" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_only_decoders_make_classifiers(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="a moderation model's arch"):
        cli.main(["make-model", "--arch", "gemma3", "--task", "classify", str(tmp_path)])


# The tokenizer


TRICKY_TEXT = (
    "Hello,  world!\n\tTabs & 'quotes' \"double\"; emoji 🎉👩‍💻, CJK 你好，世界, "
    "e\u0301 vs é, NUL \x00, <|not_special|>, trailing space "
)


def test_tokenizer_round_trips_any_text_exactly(tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tokenizer.encode(TRICKY_TEXT)
    assert tokenizer.decode(ids) == TRICKY_TEXT


def test_every_architecture_tokenizes_alike_but_qwen2_normalises_to_nfc(
    tiny_llama: Path, tiny_qwen2: Path, tiny_mistral: Path
) -> None:
    llama, qwen2, mistral = (
        AutoTokenizer.from_pretrained(p) for p in (tiny_llama, tiny_qwen2, tiny_mistral)
    )
    nfc_text = unicodedata.normalize("NFC", TRICKY_TEXT)
    assert llama.encode(nfc_text) == qwen2.encode(nfc_text) == mistral.encode(nfc_text)
    assert qwen2.decode(qwen2.encode(TRICKY_TEXT)) == nfc_text != TRICKY_TEXT


def test_special_tokens_take_the_last_ids_and_no_bos_is_added(tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert len(tokenizer) == 16384
    assert SPECIAL_TOKEN_IDS == {ENDOFTEXT: 16381, IM_START: 16382, IM_END: 16383}
    assert tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END]) == [16381, 16382, 16383]
    assert tokenizer.bos_token is None
    assert (tokenizer.eos_token, tokenizer.pad_token) == (IM_END, ENDOFTEXT)
    assert sorted(tokenizer.all_special_ids) == [16381, 16382, 16383]
    assert tokenizer.encode(f"{IM_START}hi{IM_END}") == [16382, *tokenizer.encode("hi"), 16383]
    assert all(i < FIRST_SPECIAL_ID for i in tokenizer.encode("hi"))
    assert (
        tokenizer.decode([16382, *tokenizer.encode("hi"), 16383], skip_special_tokens=True) == "hi"
    )
    generation_config = json.loads((tiny_llama / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == [16383, 16381]


# The chat template


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_chat_template_renders_chatml_with_a_generation_prompt(tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "How "}, {"type": "text", "text": "are you?"}],
        },
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert without_prompt == rendered.removesuffix("<|im_start|>assistant\n")


def test_chat_template_renders_tools_tool_calls_and_tool_results(tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather in Paris and Köln?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                # OpenAI sends arguments as a JSON string; transformers users pass a dict.
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Köln"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{json.dumps(WEATHER_TOOL)}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris and Köln?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_lists_tools_without_a_system_message(tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    messages = [{"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False)
    assert rendered.startswith("<|im_start|>system\n# Tools\n\n")
    assert rendered.endswith("</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


# Context sensitivity: what makes these checkpoints useful to engine tests


def test_changing_any_one_prompt_token_changes_the_continuation(
    tiny_model: PreTrainedModel,
) -> None:
    prompt = _prompt(24, seed=1)
    continuation = _greedy(tiny_model, prompt, 32)
    for position in (0, 1, 8, 23):
        changed = _with_token_changed(prompt, position)
        assert _greedy(tiny_model, changed, 32) != continuation, f"position {position}"


def test_continuation_depends_on_tokens_far_back(tiny_model: PreTrainedModel) -> None:
    prompt = _prompt(300, seed=2)
    changed = _with_token_changed(prompt, 1)
    assert _greedy(tiny_model, changed, 32) != _greedy(tiny_model, prompt, 32)
    # Not merely a near-tie flipped by a tiny change: the next-token logits move visibly.
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompt, changed])).logits[:, -1]
    assert (logits[0] - logits[1]).abs().max() > 0.1


def test_continuation_is_varied_and_does_not_cycle(tiny_model: PreTrainedModel) -> None:
    continuation = _greedy(tiny_model, _prompt(24, seed=3), 64)
    assert len(set(continuation)) >= 24
    tail = continuation[-32:]
    for period in range(1, 17):
        assert tail[period:] != tail[:-period], f"the continuation repeats every {period} tokens"


def test_logits_spread_wide_enough_that_the_top_two_are_rarely_near_ties(
    tiny_model: PreTrainedModel,
) -> None:
    # Greedy equality with transformers is checked in float32: a near-tie could flip either way.
    prompts = torch.tensor([_prompt(128, seed=seed) for seed in range(8)])
    with torch.no_grad():
        logits = tiny_model(prompts).logits.flatten(0, 1)
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert 3.0 < logits.std(dim=-1).mean() < 8.0
    assert gaps.median() > 0.5
    assert (gaps < 0.01).float().mean() < 0.02


def test_long_prompts_stay_finite(tiny_model: PreTrainedModel) -> None:
    with torch.no_grad():
        logits = tiny_model(torch.tensor([_prompt(500, seed=5)])).logits
    assert torch.isfinite(logits).all()
    assert logits.abs().max() < 100


# LLaVA


@pytest.mark.parametrize("size, tokens", [("tiny", 16), ("small", 576)])
def test_llava_config_nests_a_llama_and_a_clip_tower(size: str, tokens: int) -> None:
    config = model_config("llava", size)
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "llama"
    assert config["vision_config"]["model_type"] == "clip_vision_model"
    # The image token is the one id past the demo tokenizer's, inside the Llama's vocabulary.
    assert config["image_token_index"] == 16384 == config["text_config"]["vocab_size"] - 1
    assert config["image_seq_length"] == tokens


def _loaded_whole(model_class: Any, path: Path) -> PreTrainedModel:
    """transformers' `model_class` from `path`, every tensor of the checkpoint used and none
    missing."""
    model, info = model_class.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
    return model.eval()


def test_transformers_loads_llava_with_its_processor(make_checkpoint: MakeCheckpoint) -> None:
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = make_checkpoint("llava")
    _loaded_whole(LlavaForConditionalGeneration, path)
    processor = AutoProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<image>Hi<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(images=[Image.new("RGB", (90, 30))], text=text, return_tensors="pt")
    assert inputs["pixel_values"].shape == (1, 3, 56, 56)
    assert (inputs["input_ids"] == 16384).sum() == 16  # one placeholder per 14x14 patch


# Qwen2-VL


def test_qwen2_vl_config_nests_a_qwen2_with_mrope_and_a_vit() -> None:
    config = model_config("qwen2_vl", "tiny")
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    text, vision = config["text_config"], config["vision_config"]
    assert text["model_type"] == "qwen2_vl_text" and vision["model_type"] == "qwen2_vl_vision"
    # M-RoPE's three sections share each head's frequencies.
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2
    # The vision tokens follow the demo tokenizer's; the merger writes the text model's width.
    assert config["image_token_id"] == 16386 and text["vocab_size"] == 16388
    assert vision["hidden_size"] == text["hidden_size"]


def test_transformers_loads_qwen2_vl_with_its_image_processor(
    make_checkpoint: MakeCheckpoint,
) -> None:
    """The whole Qwen2VLProcessor needs torchvision for its video half; its image processor and
    tokenizer are what images need, and load on Pillow."""
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration

    path = make_checkpoint("qwen2_vl")
    _loaded_whole(Qwen2VLForConditionalGeneration, path)
    assert json.loads((path / "processor_config.json").read_text()) == {
        "processor_class": "Qwen2VLProcessor"
    }
    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>Hi" in text
    processor = AutoImageProcessor.from_pretrained(path)

    def grid(width: int, height: int) -> list[int]:
        image = Image.new("RGB", (width, height))
        return processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()

    # Sides to multiples of 28 pixels, the aspect ratio about kept, within tiny's 112x112 pixels
    # and at least 56x56.
    assert grid(300, 100) == [1, 4, 12]
    assert grid(20, 20) == [1, 4, 4]


# Qwen2-Audio


def _tone(hertz: float, seconds: float = 2.0) -> Any:
    import numpy as np

    t = np.arange(int(16_000 * seconds)) / 16_000
    return (0.5 * np.sin(2 * np.pi * hertz * t)).astype(np.float32)


def test_qwen2_audio_config_nests_a_qwen2_and_a_whisper_style_encoder() -> None:
    config = model_config("qwen2_audio", "tiny")
    assert config["architectures"] == ["Qwen2AudioForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "qwen2"
    audio = config["audio_config"]
    assert audio["model_type"] == "qwen2_audio_encoder" and audio["num_mel_bins"] == 128
    assert audio["max_source_positions"] == 1500  # 30 s of 10 ms frames, halved by conv2
    assert config["audio_token_index"] == 16386 == config["text_config"]["vocab_size"] - 1


def test_transformers_loads_qwen2_audio_and_hears_the_tone(make_checkpoint: MakeCheckpoint) -> None:
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    path = make_checkpoint("qwen2_audio")
    model = _loaded_whole(Qwen2AudioForConditionalGeneration, path)
    processor = AutoProcessor.from_pretrained(path)
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Hi"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert "<|audio_bos|><|AUDIO|><|audio_eos|>Hi" in text

    def answer(hertz: float) -> list[int]:
        inputs = processor(text=text, audio=[_tone(hertz)], return_tensors="pt")
        assert (inputs["input_ids"] == 16386).sum() == 50  # one token per 40 ms of 2 s
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    assert answer(440) == answer(440) != answer(880)


@pytest.mark.parametrize("args", [["--arch", "bert"], ["--arch", "qwen2", "--task", "embed"]])
def test_an_embedding_model_is_a_sentence_transformers_checkpoint(args: list[str], tmp_path: Path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    assert cli.main(["make-model", *args, str(tmp_path)]) == 0
    model, info = AutoModel.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
    config = json.loads((tmp_path / "config.json").read_text())
    pooling = json.loads((tmp_path / "1_Pooling" / "config.json").read_text())
    encoder = SentenceTransformer(str(tmp_path), device="cpu")
    vectors = encoder.encode(["a river", "an old stone bridge"], convert_to_tensor=True)
    assert vectors.shape == (2, 128)
    torch.testing.assert_close(vectors.norm(dim=1), torch.ones(2))  # its Normalize module
    if args[1] == "bert":
        assert type(model).__name__ == "BertModel" and pooling["pooling_mode_mean_tokens"]
        assert encoder.max_seq_length == 256  # below its 512 positions, as MiniLM's
        tokenizer = AutoTokenizer.from_pretrained(tmp_path)
        ids = tokenizer("a river")["input_ids"]
        assert tokenizer.convert_ids_to_tokens([ids[0], ids[-1]]) == ["[CLS]", "[SEP]"]
    else:
        assert type(model).__name__ == "Qwen2Model" and pooling["pooling_mode_lasttoken"]
        assert config["matryoshka_dimensions"] == [128, 64, 32]


def test_only_some_archs_make_embedding_models(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="an embedding model's arch is one of bert, llama, qwen2"):
        cli.main(["make-model", "--arch", "gemma3", "--task", "embed", str(tmp_path)])
    with pytest.raises(SystemExit, match="bert makes an embedding model only"):
        cli.main(["make-model", "--arch", "bert", "--task", "classify", str(tmp_path)])

"""Checkpoints load however they are laid out; architectures come from config.json or plugins."""

import json
import shutil
import sys
import textwrap

import pytest
import torch
from native_bf16 import needs_native_bf16
from safetensors.torch import load_file, save_file

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.worker.models.registry import resolve_model_class, supported_architectures

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(100, 140))


def copy_without_weights(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)


def test_sharded_checkpoint_gives_the_same_tokens(tiny_llama, tmp_path):
    tensors = load_file(tiny_llama / "model.safetensors")
    names = sorted(tensors)
    copy_without_weights(tiny_llama, tmp_path)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, tmp_path / file)
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expected = LLM(tiny_llama, num_kv_blocks=32).generate([PROMPT], GREEDY)[0].token_ids
    assert LLM(tmp_path, num_kv_blocks=32).generate([PROMPT], GREEDY)[0].token_ids == expected


@needs_native_bf16
def test_bfloat16_checkpoint_runs_in_bfloat16(tiny_llama, tmp_path):
    copy_without_weights(tiny_llama, tmp_path)
    tensors = load_file(tiny_llama / "model.safetensors")
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, tmp_path / "model.safetensors")
    llm = LLM(tmp_path, dtype="bfloat16", num_kv_blocks=32)
    assert llm.engine.runner.dtype is torch.bfloat16
    fp32 = LLM(tiny_llama, num_kv_blocks=32).generate([PROMPT], GREEDY)[0].token_ids
    bf16 = llm.generate([PROMPT], GREEDY)[0].token_ids
    assert len(bf16) == 12
    assert bf16[0] == fp32[0]  # rounding may diverge later, not at once


def test_missing_tensor_is_named(tiny_llama, tmp_path):
    copy_without_weights(tiny_llama, tmp_path)
    tensors = load_file(tiny_llama / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="norm.weight"):
        LLM(tmp_path, num_kv_blocks=32)


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        resolve_model_class("NopeForCausalLM")
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(
        supported_architectures()
    )


def test_plugins_register_architectures_through_entry_points(tiny_llama, tmp_path, monkeypatch):
    # A plugin distribution on sys.path: a module and its dist-info with the entry point.
    (tmp_path / "toy_plugin.py").write_text(
        textwrap.dedent("""
        from pagedbatch.engine.worker.models.llama import LlamaForCausalLM

        class ToyForCausalLM(LlamaForCausalLM):
            loaded = 0

            def load_weights(self, weights):
                type(self).loaded += 1
                super().load_weights(weights)
    """)
    )
    dist = tmp_path / "toy_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[pagedbatch.models]\nToyForCausalLM = toy_plugin:ToyForCausalLM\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model_dir = tmp_path / "toy"
    shutil.copytree(tiny_llama, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["ToyForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))

    assert "ToyForCausalLM" in supported_architectures()
    out = LLM(model_dir, num_kv_blocks=32).generate([PROMPT], GREEDY)[0]
    assert sys.modules["toy_plugin"].ToyForCausalLM.loaded == 1
    expected = LLM(tiny_llama, num_kv_blocks=32).generate([PROMPT], GREEDY)[0]
    assert out.token_ids == expected.token_ids

"""A checkpoint fills every parameter of the model, every part of a fused one, or the model is not
built: a tensor left out, one the model has no place for, or one of the wrong shape stops the
load with an error naming it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedbatch.engine import LLM

Edit = Callable[[dict[str, torch.Tensor]], None]


def edited(checkpoint: Path, tmp_path: Path, edit: Edit) -> Path:
    """A copy of `checkpoint` whose tensors `edit` changed in place."""
    copy = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, copy)
    [weights] = copy.glob("*.safetensors")
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)
    return copy


@pytest.mark.parametrize(
    ("arch", "edit", "error"),
    [
        (
            "llama",
            lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"),
            "checkpoint lacks tensors for: layers.0.self_attn.qkv_proj.weight#1",
        ),
        (
            "llama",
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            "checkpoint lacks tensors for: layers.1.mlp.gate_up_proj.weight#1",
        ),
        (
            "llama",
            lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}),
            "checkpoint tensor 'model.layers.0.extra.weight' matches no model parameter",
        ),
        (
            "llama",
            lambda t: t.update({"model.norm.weight": torch.zeros(3)}),
            "checkpoint tensor 'model.norm.weight' has shape (3,), the model expects",
        ),
        (
            "bert",
            lambda t: t.pop("encoder.layer.0.attention.self.value.bias"),
            "checkpoint lacks tensors for: layers.0.qkv.bias#2",
        ),
        (
            "bert",
            lambda t: t.pop("encoder.layer.0.output.LayerNorm.weight"),
            "checkpoint lacks tensors for: layers.0.output_norm.weight",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fill_the_model_is_refused_naming_the_tensor(
    make_checkpoint, tmp_path, arch, edit, error
):
    checkpoint = edited(make_checkpoint(arch), tmp_path, edit)
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        LLM(checkpoint, num_kv_blocks=16)


def test_a_tied_head_may_come_with_or_without_its_copy(make_checkpoint, tmp_path):
    tied = make_checkpoint("llama", tie_word_embeddings=True)

    def add_copy(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    prompts = ["one two three"]
    want = LLM(tied, num_kv_blocks=16).generate(prompts)[0].outputs[0].token_ids
    got = LLM(edited(tied, tmp_path, add_copy), num_kv_blocks=16).generate(prompts)
    assert got[0].outputs[0].token_ids == want

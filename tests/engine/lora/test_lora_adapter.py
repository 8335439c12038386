"""What a served LoRA adapter may be: a PEFT folder of plain LoRA on the linears the engine
adapts, of rank at most max_lora_rank; `lora_modules` is NAME=PATH pairs. Anything else stops
the start with a ValueError that names it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedbatch.engine.config import EngineArgs
from pagedbatch.engine.lora.adapter import load_adapter


def write_adapter(folder: Path, rank: int = 8, module: str = "q_proj", **config) -> Path:
    folder.mkdir()
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, **config}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    prefix = f"base_model.model.model.layers.0.self_attn.{module}"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.ones(rank, 64),
            f"{prefix}.lora_B.weight": torch.ones(64, rank),
        },
        folder / "adapter_model.safetensors",
    )
    return folder


def test_a_peft_folder_loads_with_its_scaling(tmp_path):
    adapter = load_adapter("a", write_adapter(tmp_path / "a"), max_rank=16)
    assert (adapter.rank, adapter.scaling) == (8, 2.0)
    a, b = adapter.weights["layers.0.self_attn.q_proj"]
    assert a.shape == (8, 64) and b.shape == (64, 8)
    rslora = load_adapter("r", write_adapter(tmp_path / "r", use_rslora=True), max_rank=16)
    assert rslora.scaling == pytest.approx(16 / 8**0.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 32}, "rank 32 is above max_lora_rank 16"),
        ({"module": "embed_tokens"}, "targets 'layers.0.self_attn.embed_tokens'"),
        ({"use_dora": True}, "use_dora not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save not supported"),
        ({"peft_type": "IA3"}, "peft_type 'IA3', not LORA"),
    ],
)
def test_what_is_not_served_is_refused_by_name(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_adapter("x", write_adapter(tmp_path / "x", **kwargs), max_rank=16)


def test_a_folder_without_an_adapter_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        load_adapter("x", tmp_path, max_rank=16)


def test_lora_modules_are_name_path_pairs():
    args = EngineArgs(model="m", lora_modules="a=/x/a, b=/x/b")
    assert args.lora_paths() == {"a": Path("/x/a"), "b": Path("/x/b")}
    with pytest.raises(ValueError, match="NAME=PATH pairs, got '/x/a'"):
        EngineArgs(model="m", lora_modules="/x/a")
    with pytest.raises(ValueError, match="names adapter 'a' twice"):
        EngineArgs(model="m", lora_modules="a=/x/a,a=/x/b")


def test_shapes_and_targets_are_checked_against_the_model(tmp_path):
    folder = write_adapter(tmp_path / "a")
    shapes = {"layers.0.self_attn.q_proj": (64, 64)}
    assert load_adapter("a", folder, max_rank=16, shapes=shapes).rank == 8
    with pytest.raises(ValueError, match="q_proj is 64x64, the model's is 32x64"):
        load_adapter("a", folder, max_rank=16, shapes={"layers.0.self_attn.q_proj": (64, 32)})
    with pytest.raises(ValueError, match="targets layers.0.self_attn.q_proj, which this model"):
        load_adapter("a", folder, max_rank=16, shapes={"layers.1.self_attn.q_proj": (64, 64)})


def test_a_hostile_weights_file_is_refused_before_its_tensors_are_read(tmp_path):
    folder = write_adapter(tmp_path / "a")
    weights = folder / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data + b"\0" * 1024)  # more bytes than its tensors take
    with pytest.raises(ValueError, match="its header accounts for"):
        load_adapter("a", folder, max_rank=16)
    weights.write_bytes((1 << 40).to_bytes(8, "little") + data[8:])  # a header of a terabyte
    with pytest.raises(ValueError, match="header is larger than"):
        load_adapter("a", folder, max_rank=16)
    header = json.dumps(
        {"x.q_proj.lora_A.weight": {"dtype": "F32", "shape": [8, 1 << 30], "data_offsets": [0, 4]}}
    ).encode()
    weights.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(ValueError, match="data_offsets do not fit its shape"):
        load_adapter("a", folder, max_rank=16)
    (folder / "adapter_config.json").write_bytes(b" " * (2 << 20))
    with pytest.raises(ValueError, match="larger than"):
        load_adapter("a", folder, max_rank=16)

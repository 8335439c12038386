"""quantization's default is what the checkpoint holds: gguf for a GGUF with blocks the kernels
read, where they run (CPU, float32, one rank, float32 matmuls); none otherwise (on CUDA too,
where gguf runs when asked for). gguf asked for where it cannot run is refused, saying why."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.quantization import holds_blocks, resolve_quantization

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def resolve(name: str | None, cfg: ModelConfig, **where) -> str:
    here = {"device": CPU, "dtype": torch.float32, "ranks": 1, "matmul_precision": "highest"}
    return resolve_quantization(name, cfg, **(here | where))


def test_a_safetensors_checkpoint_is_none_and_refuses_gguf(tiny_llama: Path):
    cfg = ModelConfig.load(tiny_llama)
    assert not holds_blocks(cfg)
    assert resolve(None, cfg) == resolve("none", cfg) == "none"
    with pytest.raises(ValueError, match="quantization gguf needs a GGUF model file"):
        resolve("gguf", cfg)


@pytest.mark.real_model
def test_a_quantized_gguf_keeps_its_blocks_where_the_kernels_run(real_model):
    cfg = ModelConfig.load(real_model("smollm2-135m-instruct"))
    assert holds_blocks(cfg)
    assert resolve(None, cfg) == resolve("gguf", cfg) == "gguf"
    assert resolve("none", cfg) == "none"
    # On CUDA (the Triton kernels) in any of its dtypes, when asked for; unset, none there.
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert resolve("gguf", cfg, device=CUDA, dtype=dtype) == "gguf"
    assert resolve(None, cfg, device=CUDA) == "none"
    elsewhere = [
        ({"device": CUDA, "ranks": 2}, "runs on one rank"),
        ({"dtype": torch.bfloat16}, "runs on the CPU in float32 or on CUDA only"),
        ({"ranks": 2}, "runs on one rank"),
        ({"matmul_precision": "bfloat16"}, "with matmul_precision highest"),
    ]
    for where, reason in elsewhere:
        assert resolve(None, cfg, **where) == "none"
        with pytest.raises(ValueError, match=reason):
            resolve("gguf", cfg, **where)


@pytest.mark.real_model
def test_a_gguf_of_float_tensors_is_none(real_model, tmp_path: Path):
    source = ModelConfig.load(real_model("smollm2-135m-instruct"))
    entries = json.loads((source.metadata_dir / "tensors.json").read_text())
    floats = [e | {"ggml_type": 0, "dtype": "<f4"} for e in entries]  # GGML_TYPE_F32
    (tmp_path / "tensors.json").write_text(json.dumps(floats))
    (tmp_path / "floats.gguf").write_bytes(b"")
    cfg = dataclasses.replace(source, path=tmp_path / "floats.gguf", metadata_dir=tmp_path)
    assert not holds_blocks(cfg)
    assert resolve(None, cfg) == "none"

"""What serving a GGUF holds in memory (issue 34): the model as many bytes as the file's
tensors, and no transformers model-loading machinery pulled in to read the tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from commands import python_output

from pagedbatch.engine import LLM
from pagedbatch.engine.tokenizer import load_tokenizer
from pagedbatch.engine.worker import gguf

SMOLLM2 = "smollm2-135m-instruct"


def file_tensor_bytes(gguf_file: Path) -> int:
    """The bytes the file's tensors take, as tensors.json says where each lies."""
    entries = json.loads((gguf.metadata_dir(gguf_file) / "tensors.json").read_text())
    return sum(math.prod(e["shape"]) * np.dtype(e["dtype"]).itemsize for e in entries)


@pytest.mark.real_model
def test_smollm2_holds_its_weights_as_the_files_bytes(real_model):
    """Every weight stays in its blocks, once: a float copy beside them (an untied head's, an
    embedding dequantized, a loader's leftover) would add 113 MiB for the embedding alone."""
    path = real_model(SMOLLM2)
    resident = LLM(path, num_kv_blocks=16).engine.resident
    stored = file_tensor_bytes(path)
    held = resident.weights_bytes + resident.quantized_bytes
    # The float weights beside the blocks: the norms (stored float32 in the file) and the
    # rotary tables (8,192 positions x 64 of cos and sin, 2 MiB), nothing else.
    assert resident.quantized_bytes <= stored
    assert abs(held - stored) <= 0.03 * stored, (held, stored)


@pytest.mark.real_model
def test_gemmas_tokenizer_keeps_no_python_copy_of_its_vocabulary(real_model):
    """transformers' Gemma tokenizer class builds its Rust tokenizer from the 262,144 tokens and
    514,906 merges read into Python, and keeps those, 145 MiB; the engine's is read from
    tokenizer.json as it is (gguf.TOKENIZER_CLASS), and encodes and decodes as that class."""
    from transformers import GemmaTokenizer

    meta = gguf.metadata_dir(real_model("gemma-3-270m"))
    kept = GemmaTokenizer.from_pretrained(meta)
    ours = load_tokenizer(meta)
    assert len(vars(kept)["_merges"]) == 514906
    assert "_vocab" not in vars(ours) and "_merges" not in vars(ours)
    assert ours.backend_tokenizer.to_str() == kept.backend_tokenizer.to_str()
    text = "Héllo,  wörld!\n\n<start_of_turn>user\n日本語 🎉 tabs\tand    spaces<end_of_turn>"
    ids = kept(text).input_ids
    assert ours(text).input_ids == ids and ours.decode(ids) == kept.decode(ids)
    assert ours.get_vocab() == kept.get_vocab()


def test_the_tokenizer_loads_without_transformers_model_machinery(tiny_llama: Path):
    """AutoTokenizer given no config builds the architecture's config class, whose module
    imports accelerate, boto3, torch.distributed.tensor and sympy (some 900 modules, 65 MiB of
    the engine's memory); the engine names the tokenizer's class through a light config."""
    script = (
        "import sys, json\n"
        "from pagedbatch.engine.tokenizer import load_tokenizer\n"
        f"tokenizer = load_tokenizer({str(tiny_llama)!r})\n"
        "heavy = [m for m in ('sympy', 'accelerate', 'torch.distributed.tensor') "
        "if m in sys.modules]\n"
        "print(json.dumps([type(tokenizer).__name__, heavy]))\n"
    )
    name, heavy = json.loads(python_output("-c", script, timeout=300).splitlines()[-1])
    assert heavy == []
    from transformers import AutoTokenizer

    assert name == type(AutoTokenizer.from_pretrained(tiny_llama)).__name__

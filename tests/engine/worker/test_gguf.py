"""GGUF files as models: found by path, named by their stem, read once into a metadata cache, and
refused with a clear error (before anything is loaded) when they cannot be served."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from transformers import AutoTokenizer

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.config import ModelConfig, default_model_name
from pagedbatch.engine.tokenizer import load_tokenizer
from pagedbatch.engine.worker import gguf
from pagedbatch.engine.worker.gguf import cache_root, find_gguf


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_gguf(path: Path, arch: str, rows: int = 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((rows, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_is_found_as_a_file_or_alone_in_a_directory(tmp_path: Path, tiny_llama: Path):
    model = write_gguf(tmp_path / "m" / "My-Model.Q8_0.gguf", "llama")
    assert find_gguf(model) == model
    assert find_gguf(model.parent) == model
    assert find_gguf(tiny_llama) is None  # a Hugging Face directory
    assert default_model_name(model) == default_model_name(model.parent) == "My-Model.Q8_0"
    write_gguf(tmp_path / "m" / "other.gguf", "llama")
    with pytest.raises(ValueError, match="several GGUF files.*My-Model.Q8_0.gguf, other.gguf"):
        find_gguf(model.parent)


def test_an_unsupported_architecture_is_named_and_nothing_is_cached(tmp_path: Path, cache_home):
    model = write_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(ValueError, match="GGUF architecture 'phi3' is not supported; supported: "):
        LLM(model)
    assert not any(cache_root().glob("*/tensors.json"))


def test_a_truncated_file_is_refused(tmp_path: Path, cache_home):
    whole = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 1000])
    with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file .truncated"):
        ModelConfig.load(cut)
    assert not any(cache_root().glob("*/tensors.json"))


@pytest.mark.real_model
def test_a_real_model_cut_short_is_refused(tmp_path: Path, real_model):
    source = real_model("smollm2-135m-instruct")
    cut = tmp_path / source.name
    with source.open("rb") as f:
        cut.write_bytes(f.read(source.stat().st_size // 2))
    with pytest.raises(ValueError, match="truncated"):
        LLM(cut)


@pytest.mark.real_model
def test_metadata_is_read_once_and_again_when_the_file_changes(
    tmp_path: Path, cache_home, real_model
):
    model = tmp_path / "smol.gguf"
    shutil.copyfile(real_model("smollm2-135m-instruct"), model)
    first = ModelConfig.load(model)
    assert first.path == model and first.architecture == "LlamaForCausalLM"
    assert (first.num_layers, first.hidden_size, first.vocab_size) == (30, 576, 49152)
    stamp = (first.metadata_dir / "tensors.json").stat().st_mtime_ns
    assert ModelConfig.load(model).metadata_dir == first.metadata_dir
    assert (first.metadata_dir / "tensors.json").stat().st_mtime_ns == stamp
    model.touch()
    assert ModelConfig.load(model).metadata_dir != first.metadata_dir


@pytest.mark.real_model
def test_the_tokenizer_is_kept_as_the_rust_tokenizer_reads_it_the_one_in_the_file(real_model):
    """The metadata's tokenizer loads straight from tokenizer.json (no class that rebuilds it
    from Python lists), its merges written as "a b" strings (lighter to parse than pairs), and
    it is the tokenizer transformers reads from the GGUF, to the last setting."""
    model = real_model("smollm2-135m-instruct")
    meta = ModelConfig.load(model).metadata_dir
    config = json.loads((meta / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == gguf.TOKENIZER_CLASS == "TokenizersBackend"
    merges = json.loads((meta / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]
    assert len(merges) > 40_000 and all(isinstance(m, str) and m.count(" ") == 1 for m in merges)
    ours = load_tokenizer(meta)
    theirs = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    assert type(ours).__name__ == "TokenizersBackend"
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    chat = [{"role": "user", "content": "Üñí  code\n\n and\ttabs"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat)


@pytest.mark.real_model
def test_the_metadata_is_read_in_a_process_of_its_own(
    tmp_path: Path, cache_home, real_model, monkeypatch: pytest.MonkeyPatch
):
    # The vocabulary's Python objects stay out of the engine's process (gguf.py's top): here,
    # reading it in this process fails, and the file loads all the same.
    def in_this_process(*args):
        raise AssertionError("the metadata was read in the engine's process")

    monkeypatch.setattr(gguf, "_write_metadata", in_this_process)
    model = tmp_path / "smol.gguf"
    shutil.copyfile(real_model("smollm2-135m-instruct"), model)
    assert ModelConfig.load(model).vocab_size == 49152


@pytest.mark.real_model
def test_a_gguf_serves_under_its_stem_with_its_own_end_token(real_model):
    llm = LLM(real_model("smollm2-135m-instruct"), num_kv_blocks=64)
    assert llm.engine.model_name == "SmolLM2-135M-Instruct.Q4_1"
    im_end = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in llm.engine.eos_token_ids
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64))
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] == im_end


def test_a_chat_template_setting_is_inline_jinja_or_a_file(tmp_path: Path, tiny_llama: Path):
    inline = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    assert LLM(tiny_llama, num_kv_blocks=16, chat_template=inline).tokenizer.chat_template == inline
    template_file = tmp_path / "template.jinja"
    template_file.write_text(inline)
    llm = LLM(tiny_llama, num_kv_blocks=16, chat_template=str(template_file))
    assert llm.tokenizer.chat_template == inline
    with pytest.raises(ValueError, match="neither a Jinja template nor a file"):
        LLM(tiny_llama, num_kv_blocks=16, chat_template=str(tmp_path / "missing.jinja"))


@pytest.mark.real_model
def test_an_unwritable_cache_falls_back_to_the_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, real_model
):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_dir))
    config = ModelConfig.load(real_model("smollm2-135m-instruct"))
    assert config.metadata_dir.is_relative_to(tempfile.gettempdir())
    assert (config.metadata_dir / "tensors.json").is_file()

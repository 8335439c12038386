"""GGUF checkpoints (llama.cpp's one-file format): dequantized at load, or kept in their blocks.

A GGUF file carries the config, the tokenizer and the (usually quantized) weights together.
Reading its metadata takes seconds (a Python loop over every vocabulary entry: about 15 s for
Gemma 3's 262,144 tokens) and turning it into a config and a tokenizer takes transformers as long
again, so that is done once per file: `metadata_dir` writes what a Hugging Face directory would
hold (config.json, generation_config.json, the tokenizer files) and `tensors.json`, where each
tensor lies in the file and the name transformers gives it, into a cache directory keyed by the
file's path, size and modification time. It does so in a process of its own: Gemma 3's vocabulary
took 1.6 GiB at its peak and left the process 500 MiB larger, heap it never handed back.
Every load after the first reads those, and the weights come one tensor at a time, read from the
file (`_read`) and dequantized by the `gguf` package to float32: the file is never read whole
into memory, and a checkpoint never sits in memory twice.

The tensors are rearranged as transformers does it (its `TENSOR_PROCESSORS`: llama.cpp permutes
Llama's q/k rows for its rotary layout and stores Gemma's norms as 1 + weight), so a GGUF loads
into the same models as its safetensors original.

With `keep_quantized` (quantization gguf), a 2-D tensor in a format the quantized kernels read
(`quant_blocks.Format`: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) comes as a `QuantizedTensor`:
its blocks, copied out of the file, with rows in transformers' order. Rearranging blocks is
possible only where the processor merely reorders rows; a tensor it changes otherwise comes
dequantized, as without the option.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from pagedbatch.kernels.quant_blocks import Format
from pagedbatch.kernels.quant_linear import QuantizedTensor

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"
# Bump when what metadata_dir writes changes, so older cache entries are rebuilt.
_FORMAT = 3
# The tokenizer class metadata_dir names (see `_light_to_load`).
TOKENIZER_CLASS = "TokenizersBackend"
# general.architecture -> the architecture config.json would name.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Token ids a GGUF lists besides eos that end a turn (llama.cpp's end-of-generation tokens).
_END_TOKEN_FIELDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
# Special tokens that end a turn whatever the metadata says, as llama.cpp treats them: a GGUF
# often names only its eos (Gemma's <eos>), while chat turns end with one of these.
_END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in the file, and what transformers calls it."""

    gguf_name: str
    hf_name: str
    ggml_type: int
    offset: int
    dtype: str  # the stored elements' numpy dtype (uint8 bytes for quantized types)
    shape: list[int]  # the stored array's numpy shape


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file a model path names: the path itself, or the one .gguf in a directory that has
    no config.json. None for a Hugging Face directory."""
    path = Path(path)
    if path.is_file() and path.suffix == SUFFIX:
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"{path} holds several GGUF files ({names}); name one as the model")
    return files[0] if files else None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedbatch" / "gguf"


def metadata_dir(gguf_file: Path) -> Path:
    """A directory with the file's config.json, generation_config.json, tokenizer and
    tensors.json; made on first use, then reused while the file is unchanged."""
    gguf_file = gguf_file.resolve()
    stat = gguf_file.stat()
    key = f"{_FORMAT}:{gguf_file}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_root() / f"{gguf_file.stem}-{digest}"
    if (target / "tensors.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home, say: the machine's temporary directory serves
        fallback = Path(tempfile.gettempdir()) / "pagedbatch" / "gguf" / target.name
        logger.warning("cannot write to %s (%s); keeping GGUF metadata in %s", target, e, fallback)
        target = fallback
        if (target / "tensors.json").is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        _write_metadata_apart(gguf_file, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first; its copy is as good
            if not (target / "tensors.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "read the metadata of %s into %s in %.1f s (once per file)",
        gguf_file,
        target,
        time.perf_counter() - started,
    )
    return target


# The exit status of `_metadata_child` for a file it cannot read (its ValueError), the message in
# the staging directory's ERROR_FILE.
BAD_FILE = 3
ERROR_FILE = "error.txt"


def _write_metadata_apart(gguf_file: Path, out: Path) -> None:
    """`_write_metadata` in a child process (see the top); a ValueError there is one here.
    A process, not a multiprocessing one: Celery's pool workers are daemons, which may not have
    those."""
    code = (
        "import sys; from pagedbatch.engine.worker import gguf; gguf._metadata_child(*sys.argv[1:])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(gguf_file), str(out)], capture_output=True, text=True
    )
    if done.returncode == BAD_FILE:
        raise ValueError((out / ERROR_FILE).read_text())
    if done.returncode != 0:
        raise RuntimeError(f"reading the metadata of {gguf_file} failed: {done.stderr[-2000:]}")


def _metadata_child(gguf_file: str, out: str) -> None:
    try:
        _write_metadata(Path(gguf_file), Path(out))
    except ValueError as e:
        (Path(out) / ERROR_FILE).write_text(str(e))
        sys.exit(BAD_FILE)


def _write_metadata(gguf_file: Path, out: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    try:
        reader = GGUFReader(gguf_file)
    except Exception as e:  # the reader raises whatever numpy does on a short or corrupt file
        raise ValueError(
            f"{gguf_file} is not a readable GGUF file (truncated or corrupt): {e}"
        ) from e
    _check_complete(gguf_file, reader)
    fields = {name: field.contents() for name, field in reader.fields.items() if _small(name)}
    gguf_arch = fields.get("general.architecture")
    if gguf_arch not in ARCHITECTURES:
        raise ValueError(
            f"{gguf_file}: GGUF architecture {gguf_arch!r} is not supported; supported: "
            + ", ".join(sorted(ARCHITECTURES))
        )
    try:
        config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except Exception as e:
        raise ValueError(f"{gguf_file}: transformers cannot read its metadata: {e}") from e
    raw = config.to_dict()
    # llama.cpp writes Mistral as llama; transformers tells them apart by general.name.
    mistral = raw["model_type"] == "mistral"
    raw["architectures"] = ["MistralForCausalLM" if mistral else ARCHITECTURES[gguf_arch]]
    raw["dtype"] = "float32"  # what the weights are dequantized to
    end_ids = {int(fields[f]) for f in _END_TOKEN_FIELDS if f in fields}
    specials = set(tokenizer.all_special_tokens) | set(tokenizer.added_tokens_encoder)
    end_ids |= {tokenizer.convert_tokens_to_ids(t) for t in _END_OF_TURN_TOKENS if t in specials}
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    generation = {"eos_token_id": sorted(end_ids), "bos_token_id": bos_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    _light_to_load(out)
    entries = _tensor_entries(reader, config)
    (out / "tensors.json").write_text(json.dumps([asdict(e) for e in entries]))


def _light_to_load(out: Path) -> None:
    """Rewrites the saved tokenizer to be the same tokenizer, lighter for the engine to load.

    - Its class becomes `TOKENIZER_CLASS`, the Rust tokenizer read from tokenizer.json as it is.
      The class transformers picks for the architecture (GemmaTokenizer) reads the vocabulary and
      merges into Python to build it anew: Gemma 3's 262,144 tokens left the engine 16 MiB
      larger for good.
    - Its BPE merges become "a b" strings where no token holds a space, as tokenizers reads
      either. Parsing a pair takes a list of two strings: Gemma 3's 514,906 pairs took 387 MiB
      at the parse's peak, 180 as strings."""
    config_file, tokenizer_file = out / "tokenizer_config.json", out / "tokenizer.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = TOKENIZER_CLASS
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    saved = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    model = saved["model"]
    merges = model.get("merges") if model.get("type") == "BPE" else None
    if merges and all(isinstance(m, list) and " " not in m[0] + m[1] for m in merges):
        model["merges"] = [" ".join(m) for m in merges]
        tokenizer_file.write_text(json.dumps(saved, ensure_ascii=False), encoding="utf-8")


def _small(field_name: str) -> bool:
    # The vocabulary's arrays are what make reading slow; transformers reads those itself.
    return not field_name.startswith("tokenizer.ggml.") or field_name.endswith("_id")


def _check_complete(gguf_file: Path, reader: Any) -> None:
    size = gguf_file.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise ValueError(
                f"{gguf_file} is truncated: tensor {tensor.name} ends at byte "
                f"{tensor.data_offset + tensor.n_bytes:,} of a {size:,}-byte file"
            )


def _tensor_entries(reader: Any, config: Any) -> list[TensorEntry]:
    """Each tensor's place in the file under transformers' name for it, found by mapping the
    parameters of transformers' own model class (built on the meta device, so it costs nothing)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(hf_model, _processor(config.to_dict()))
    entries = []
    for tensor in reader.tensors:
        if tensor.name not in names:
            raise ValueError(f"GGUF tensor {tensor.name!r} matches no {type(hf_model).__name__}")
        entries.append(
            TensorEntry(
                gguf_name=tensor.name,
                hf_name=names[tensor.name],
                ggml_type=int(tensor.tensor_type),
                offset=int(tensor.data_offset),
                dtype=tensor.data.dtype.str,
                shape=list(tensor.data.shape),
            )
        )
    return entries


def _processor(config: dict[str, Any]) -> Any:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    gguf_arch = config["model_type"].removesuffix("_text")
    return TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=config)


def iterate_weights(
    gguf_file: Path, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(transformers name, float32 tensor) pairs, one tensor dequantized at a time; with
    `keep_quantized`, the blocks of those the quantized kernels read (see the module's
    docstring)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    meta = metadata_dir(gguf_file)
    config = json.loads((meta / "config.json").read_text())
    processor = _processor(config)
    entries = [TensorEntry(**e) for e in json.loads((meta / "tensors.json").read_text())]
    started = time.perf_counter()
    kept = 0
    with gguf_file.open("rb") as file:
        for entry in entries:
            stored = _read(file, entry)
            fmt = Format.of(entry.ggml_type) if keep_quantized and len(entry.shape) == 2 else None
            order = _row_order(processor, entry) if fmt is not None else None
            if fmt is not None and order is not None:
                if not np.array_equal(order, np.arange(len(order))):
                    stored = stored[order]
                kept += 1
                blocks = torch.from_numpy(stored)
                yield entry.hf_name, QuantizedTensor(blocks, fmt, fmt.cols(entry.shape[1]))
                continue
            weights = dequantize(stored, GGMLQuantizationType(entry.ggml_type))
            weights = processor.process(weights=weights, name=entry.gguf_name).weights
            yield entry.hf_name, torch.from_numpy(np.require(weights, np.float32, ["C", "W"]))
    logger.info(
        "read %d tensors of %s in %.1f s (%d kept quantized, the rest dequantized)",
        len(entries),
        gguf_file.name,
        time.perf_counter() - started,
        kept,
    )


def _read(file: BinaryIO, entry: TensorEntry) -> np.ndarray:
    """The tensor's stored elements, read into memory. Not through a memory map: its pages would
    count in the process's RSS until unmapped, beside what is made of them (Gemma 3's 160 MiB
    embedding twice: the load's peak RSS was 818 MiB, its end 627)."""
    stored = np.empty(tuple(entry.shape), np.dtype(entry.dtype))
    file.seek(entry.offset)
    if file.readinto(memoryview(stored).cast("B")) != stored.nbytes:
        raise ValueError(f"{file.name} ends inside tensor {entry.gguf_name}")
    return stored


def _row_order(processor: Any, entry: TensorEntry) -> np.ndarray | None:
    """The order in which the processor puts the tensor's rows, found by processing a column
    of row numbers; None where it does anything but reorder rows."""
    rows = entry.shape[0]
    probe = np.arange(rows, dtype=np.float64)[:, None]
    result = processor.process(weights=probe, name=entry.gguf_name).weights
    if result.shape != probe.shape:
        return None
    order = result[:, 0].astype(np.int64)
    if not np.array_equal(order, result[:, 0]) or not np.array_equal(np.sort(order), probe[:, 0]):
        return None
    return order

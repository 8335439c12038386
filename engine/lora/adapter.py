"""A LoRA adapter as PEFT saves it: `adapter_config.json` and `adapter_model.safetensors`.

PEFT adds `scaling * B(A(x))` to a target linear's output, `A` being `[r, in]` and `B`
`[out, r]`, with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` under `use_rslora`).
What PEFT can save beyond that (DoRA, trained biases, whole modules, per-module ranks) is refused
by name rather than served wrong.

A folder may come from an operator's request at run time (`/v1/load_lora_adapter`), so what
loading it costs is bounded before anything is allocated: the config file's size, the weights
file's header (its size, then every tensor's name, dtype, shape and place in the file, checked
against the model's linears and `max_rank`) and the file's size against what the header says;
only then are the tensors read, each at most a model linear's `[max_rank, in]` or `[out,
max_rank]`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

# The linears an adapter may target, by the name transformers gives them in a Llama-style layer.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's config is a few hundred bytes; a weights header about 150 bytes a tensor (two a
# target: 14 a layer of all seven, 1,120 for 80 layers).
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 4 << 20
# The dtypes PEFT saves adapters in, with their sizes; all are read as float32.
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    # By module path as the model names its unfused linears ("layers.0.self_attn.q_proj"):
    # (A `[r, in]`, B `[out, r]`), float32.
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(
    name: str, path: Path, max_rank: int, shapes: Mapping[str, tuple[int, int]] | None = None
) -> LoraAdapter:
    """The adapter in PEFT folder `path`; ValueError naming what it holds that is not served.
    `shapes`, where given, are the model's adaptable linears, `(in, out)` by unfused module
    path: an adapter must target only those, with matrices of their sizes."""
    where = f"LoRA adapter {name!r} ({path})"
    try:
        config = json.loads(_read_small(path / CONFIG_FILE, MAX_CONFIG_BYTES))
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not a PEFT adapter folder: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config['peft_type']!r}, not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer and lora_alpha a number")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(f"{where}: r must be a positive integer and lora_alpha a number")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above max_lora_rank {max_rank}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    if refused := [key for key, used in unsupported.items() if used]:
        raise ValueError(f"{where}: {', '.join(refused)} not supported")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = path / WEIGHTS_FILE
    try:
        header = _safetensors_header(weights)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not a PEFT adapter folder: {e}") from e
    modules = _check_header(where, header, rank, shapes)
    try:
        with safe_open(weights, framework="pt") as f:
            keys = [key for a_key, (_, b_key) in modules.items() for key in (a_key, b_key)]
            tensors = {key: f.get_tensor(key).float() for key in keys}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own errors; named here
        raise ValueError(f"{where}: {WEIGHTS_FILE} cannot be read: {e}") from e
    pairs = {module: (tensors[a_key], tensors[b_key]) for a_key, (module, b_key) in modules.items()}
    return LoraAdapter(name, rank, scaling, pairs)


def _read_small(file: Path, limit: int) -> bytes:
    with file.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{file.name} is larger than {limit} bytes")
    return data


def _safetensors_header(file: Path) -> dict[str, dict]:
    """The JSON header of a safetensors file, its tensors' `data_offsets` checked to tile the
    file's data exactly (so that its size is what the tensors need, no more)."""
    with file.open("rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{file.name} is not a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{file.name}'s header is larger than {MAX_HEADER_BYTES} bytes")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{file.name}'s header is not a JSON object")
    header.pop("__metadata__", None)
    spans = []
    for key, info in header.items():
        if not isinstance(info, dict):
            raise ValueError(f"tensor {key!r} is not described by an object")
        dtype, shape = info.get("dtype"), info.get("shape")
        offsets = info.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {key!r} is {dtype}; adapters are F32, F16, BF16 or F64")
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise ValueError(f"tensor {key!r} has no valid shape")
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise ValueError(f"tensor {key!r} has no valid data_offsets")
        begin, end = offsets
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise ValueError(f"tensor {key!r}'s data_offsets do not fit its shape")
        spans.append((begin, end))
    spans.sort()
    covered = 0
    for begin, end in spans:
        if begin != covered:
            raise ValueError(f"{file.name}'s tensors do not tile its data")
        covered = end
    if 8 + length + covered != size:
        accounted = 8 + length + covered
        raise ValueError(f"{file.name} is {size} bytes; its header accounts for {accounted}")
    return header


def _check_header(
    where: str,
    header: dict[str, dict],
    rank: int,
    shapes: Mapping[str, tuple[int, int]] | None,
) -> dict[str, tuple[str, str]]:
    """Every tensor an A or B of one module, of rank `rank` and of the model's sizes. Returns
    each A's key with its module path and its B's key."""
    halves: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for key, info in header.items():
        module, dot, half = key.removesuffix(".weight").rpartition(".")
        if not dot or half not in ("lora_A", "lora_B"):
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A or B matrix")
        module = module.removeprefix("base_model.model.").removeprefix("model.")
        if module.rpartition(".")[2] not in TARGET_MODULES:
            raise ValueError(
                f"{where}: targets {module!r}; served targets are {', '.join(TARGET_MODULES)}"
            )
        if half in halves.get(module, {}):
            raise ValueError(f"{where}: {module} has two {half} matrices")
        halves.setdefault(module, {})[half] = (key, info["shape"])
    modules = {}
    for module, found in halves.items():
        a, b = found.get("lora_A"), found.get("lora_B")
        if a is None or b is None or len(a[1]) != 2 or len(b[1]) != 2:
            raise ValueError(f"{where}: {module} needs a 2-D lora_A and lora_B")
        (a_key, (a_rank, a_in)), (b_key, (b_out, b_rank)) = a, b
        if a_rank != rank or b_rank != rank:
            raise ValueError(f"{where}: {module}'s matrices are not of rank {rank}")
        if shapes is not None:
            if module not in shapes:
                raise ValueError(f"{where}: targets {module}, which this model lacks")
            size_in, size_out = shapes[module]
            if (a_in, b_out) != (size_in, size_out):
                raise ValueError(
                    f"{where}: {module} is {b_out}x{a_in}, the model's is {size_out}x{size_in}"
                )
        modules[a_key] = (module, b_key)
    return modules

"""Engine arguments (what a user sets) and the model's shape (what config.json says)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedbatch.engine.distributed import divide

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineArgs:
    model: str
    served_model_name: str | None = None  # defaults to the model directory's base name
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's dtype on GPU
    device: str = "auto"  # auto: cuda when available
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gib
    # per rank; default: 2 GiB on CPU, 90% of free memory on GPU
    kv_cache_memory_gib: float | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "priority"  # or "fcfs"
    # Under the priority policy, while requests of a better priority are in the engine, the
    # others get at most this many tokens a step (None: no bound of their own), so the steps that
    # realtime requests wait on stay short under a batch.
    low_priority_token_budget: int | None = None
    tensor_parallel_size: int = 1  # ranks (processes; on CUDA, devices from `device` on)
    seed: int = 0  # for requests that sample without a seed of their own
    # Log a stats line (throughput, running, waiting, KV usage) this often while there is work;
    # 0: never. The service turns it on; offline runs have their progress bar.
    stats_log_interval_seconds: float = 0.0

    def __post_init__(self) -> None:
        positive = (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "tensor_parallel_size",
            "low_priority_token_budget",
        )
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.stats_log_interval_seconds < 0:
            raise ValueError(
                f"stats_log_interval_seconds must not be negative, got "
                f"{self.stats_log_interval_seconds}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")


@dataclass
class ModelConfig:
    """The parts of a Hugging Face config.json the engine runs on."""

    path: Path
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    sliding_windows: list[int | None]  # per layer
    torch_dtype: torch.dtype
    raw: dict[str, Any] = field(repr=False)

    def check_tensor_parallel(self, size: int) -> None:
        """Raises ValueError unless each of `size` ranks can hold whole heads and an equal share of
        the MLP. (The vocabulary is padded to split evenly.)"""
        divide(self.num_heads, size, "num_attention_heads")
        divide(self.num_kv_heads, size, "num_key_value_heads")
        divide(self.intermediate_size, size, "intermediate_size")

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{path} is not a model directory: no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from e
        try:
            return cls._from_raw(path, raw)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{config_file} lacks a required field: {e}") from e

    @classmethod
    def _from_raw(cls, path: Path, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ValueError(f"{path / 'config.json'} names no architectures")
        num_heads = raw["num_attention_heads"]
        num_layers = raw["num_hidden_layers"]
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        is_qwen2 = architectures[0] == "Qwen2ForCausalLM"
        return cls(
            path=path,
            architecture=architectures[0],
            hidden_size=raw["hidden_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases and never an output bias; its config.json says neither.
            qkv_bias=is_qwen2 or raw.get("attention_bias", False),
            o_proj_bias=not is_qwen2 and raw.get("attention_bias", False),
            sliding_windows=_sliding_windows(raw, num_layers),
            torch_dtype=DTYPES.get(dtype_name, torch.float32),
            raw=raw,
        )


def _sliding_windows(raw: dict[str, Any], num_layers: int) -> list[int | None]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types:  # transformers 5 states it per layer
        return [window if t == "sliding_attention" else None for t in layer_types]
    if not window or raw.get("use_sliding_window") is False:
        return [None] * num_layers
    if "max_window_layers" in raw:  # Qwen2: layers from max_window_layers on slide
        return [window if i >= raw["max_window_layers"] else None for i in range(num_layers)]
    return [window] * num_layers

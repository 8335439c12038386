"""Loads the model, owns the KV cache tensors, and runs one flattened batch per step."""

from __future__ import annotations

import time

import torch

from pagedbatch.engine.config import DTYPES, EngineArgs, ModelConfig
from pagedbatch.engine.loader import iterate_weights
from pagedbatch.engine.models.registry import resolve_model_class
from pagedbatch.engine.scheduler import ScheduledRequest
from pagedbatch.kernels.attention import prepare_attention

DEFAULT_CPU_KV_GIB = 2.0
GPU_MEMORY_FRACTION = 0.9


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    # Half precision on CPUs without AMX runs at about half the float32 rate.
    return cfg.torch_dtype if device.type == "cuda" else torch.float32


class ModelRunner:
    def __init__(self, cfg: ModelConfig, args: EngineArgs):
        self.cfg = cfg
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, cfg, self.device)
        self.block_size = args.block_size
        started = time.perf_counter()
        self.model = self._load_model()
        self.load_seconds = time.perf_counter() - started
        self.num_blocks = args.num_kv_blocks or self._blocks_for_budget(args.kv_cache_memory_gib)
        self.kv_caches = [(self._empty_cache(), self._empty_cache()) for _ in range(cfg.num_layers)]

    def _load_model(self) -> torch.nn.Module:
        model_cls = resolve_model_class(self.cfg.architecture)
        with torch.device(self.device):
            model = model_cls(self.cfg)
        model = model.to(self.dtype)
        model.load_weights(iterate_weights(self.cfg.path))
        return model.eval()

    @property
    def kv_bytes_per_block(self) -> int:
        per_token = 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim
        return per_token * self.block_size * self.dtype.itemsize

    def _blocks_for_budget(self, gib: float | None) -> int:
        if gib is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * GPU_MEMORY_FRACTION
        else:
            budget = (gib if gib is not None else DEFAULT_CPU_KV_GIB) * 2**30
        return max(1, int(budget // self.kv_bytes_per_block))

    def _empty_cache(self) -> torch.Tensor:
        shape = (self.num_blocks, self.block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        # Uninitialised on purpose: attention only reads slots that were written.
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def execute(
        self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """Run one step; returns float32 logits for the requests that sample, in order."""
        input_ids: list[int] = []
        query_start_loc = [0]
        sample_rows: list[int] = []
        for s in scheduled:
            input_ids.extend(s.request.all_token_ids[s.start : s.end])
            query_start_loc.append(len(input_ids))
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
        width = max(len(b) for b in block_tables)
        padded = [b + [0] * (width - len(b)) for b in block_tables]
        device = self.device
        meta = prepare_attention(
            query_start_loc=torch.tensor(query_start_loc, device=device),
            seq_lens=torch.tensor([s.end for s in scheduled], device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            block_size=self.block_size,
        )
        hidden = self.model(
            torch.tensor(input_ids, device=device), meta.positions, self.kv_caches, meta
        )
        rows = torch.tensor(sample_rows, dtype=torch.long, device=device)
        return self.model.compute_logits(hidden[rows]).float()

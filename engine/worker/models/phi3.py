"""Phi-3 (transformers' `Phi3ForCausalLM`): a Llama whose checkpoint already fuses q/k/v
(`qkv_proj`) and gate/up (`gate_up_proj`).

The fused tensors load into the same fused parameters as Llama's separate ones: each part of a
checkpoint tensor (q, k, v; gate, up) is handed to its shard as a view of its rows, so that each
tensor-parallel rank still reads only its slice of the file. Phi-3's context extension
(`longrope`) and partial rotary embeddings are refused rather than ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.models.llama import LlamaForCausalLM
from pagedbatch.engine.worker.models.rope import rope_parameters
from pagedbatch.engine.worker.parallel_layers import Loaded


class RowRange:
    """Rows `start:start + rows` of a checkpoint tensor, read as a tensor of their own: indexing
    it (`[a:b]`, `[:, a:b]`, `[:]`) reads only those rows of the underlying one."""

    def __init__(self, tensor: Loaded, start: int, rows: int):
        self.tensor = tensor
        self.start = start
        self.shape = (rows, *tensor.shape[1:])

    def __getitem__(self, index):
        rows, *rest = index if isinstance(index, tuple) else (index,)
        first, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("a row range reads contiguous rows only")
        shifted = slice(self.start + first, self.start + stop)
        return self.tensor[(shifted, *rest)] if rest else self.tensor[shifted]


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        rope = rope_parameters(cfg.raw)
        if rope["rope_type"] != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"Phi-3 with RoPE {rope['rope_type']!r} and partial_rotary_factor "
                f"{rope.get('partial_rotary_factor', 1.0)} is not supported (only default, 1.0)"
            )
        super().__init__(cfg)

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, Loaded]]) -> Iterator[tuple[str, Loaded]]:
        """The checkpoint with each fused tensor as its parts, named as Llama's are."""
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        splits = {
            "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (
                ("gate_proj", cfg.intermediate_size),
                ("up_proj", cfg.intermediate_size),
            ),
        }
        for name, tensor in weights:
            fused = next((f for f in splits if f".{f}." in name), None)
            if fused is None:
                yield name, tensor
                continue
            parts = splits[fused]
            total = sum(rows for _, rows in parts)
            if tensor.shape[0] != total:
                raise ValueError(
                    f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, the model expects "
                    f"{total}"
                )
            start = 0
            for part, rows in parts:
                yield name.replace(fused, part), RowRange(tensor, start, rows)
                start += rows

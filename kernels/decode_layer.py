"""A Llama (or Gemma 3) decoder layer on quantized weights, run for a decode step in one C call
(`decode_layer.c`): the norms, the four products, rotary, the cache write, attention and the
gated activation, where the layer otherwise takes two dozen torch ops and their Python frames.

`DecodeLayer` holds what a layer's call needs from load on (pointers into the weights, the norm
weights, the rotary table, the layer's KV cache); `DecodeStep` what a step gives every layer (its
tokens' positions and cache slots, the attention kernel's rows). Both keep the tensors they point
into alive. The caller checks that the layer is one this computes (see models/llama.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagedbatch.kernels import native, quant_gemm, quant_linear
from pagedbatch.kernels.attention import C_FORMATS, AttentionMetadata, decode_rows
from pagedbatch.kernels.quant_blocks import Format
from pagedbatch.kernels.quant_linear import ACTIVATIONS, QuantizedWeight

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [
        ("type", _i32), ("activations", _i32), ("blocks", _ptr), ("rows", _i64), ("cols", _i64),
        ("gemm", _ptr), ("gemm_settings", _i32 * 2),
    ]  # fmt: skip


QKV_RUNS = 3  # decode_layer.c's: q, k and v in up to three formats
# The caches decode_layer.c writes and reads: float ones.
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear * QKV_RUNS), ("qkv_runs", _i64),
        *((name, _Linear) for name in ("o", "gate_up", "down")),
        ("norm1", _ptr), ("norm2", _ptr), ("eps", _f32), ("scale", _f32),
        ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
        ("cos_sin", _ptr), ("cos_sin_rows", _i64),
        ("key_cache", _ptr), ("value_cache", _ptr), ("block_size", _i64),
        ("gemma", _i32), ("cache_format", _i32),
        ("q_norm", _ptr), ("k_norm", _ptr), ("post_attention_norm", _ptr), ("post_mlp_norm", _ptr),
    ]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _i64), ("positions", _ptr), ("slots", _ptr),
        ("tables", _ptr), ("table_width", _i64),
        ("token_rows", _ptr), ("table_rows", _ptr), ("first_keys", _ptr), ("seq_lens", _ptr),
        ("seqs", _i64), ("threads", _i32), ("streamed_rows", _i64),
    ]  # fmt: skip


def many_rows_product(fmt: Format, rows: int | None = None) -> tuple[int, int, int] | None:
    """quant_gemm.c's product as a decode layer calls it past `small_batch()` rows of x for a
    weight of `rows` rows (None: any) in `fmt`: the address and two settings (`quant_gemm.entry`)
    of the product they take here (`gemm_path`); None where they take the float32 tiles, which C
    does not call."""
    gemm = quant_linear.gemm_path(fmt, rows)
    return None if gemm is None else quant_gemm.entry(*gemm)


def takes(rows: int, formats: Iterable[Format]) -> bool:
    """Whether a decode step of `rows` one-token sequences, its weights in `formats`, runs its
    layers here: a few, whose products stream the blocks; any number where many rows of each
    format have a `many_rows_product`."""
    if rows <= quant_linear.small_batch():
        return True
    formats = tuple(formats)
    return bool(formats) and all(many_rows_product(fmt) is not None for fmt in formats)


def fusable(weight: object, runs: int = 1) -> bool:
    """Whether a linear's weight is one `DecodeLayer` multiplies with: blocks in at most `runs`
    runs of one format each (q, k and v may take `QKV_RUNS`, the other linears one)."""
    return isinstance(weight, QuantizedWeight) and len(weight.runs) <= runs


def _linears(weight: QuantizedWeight) -> list[_Linear]:
    linears = []
    for blocks, fmt in weight.runs:
        gemm, *settings = many_rows_product(fmt, blocks.shape[0]) or (None, 0, 0)
        linears.append(
            _Linear(
                fmt.ggml_type,
                ACTIVATIONS[weight.activations[fmt]],
                blocks.data_ptr(),
                blocks.shape[0],
                weight.cols,
                gemm,
                (_i32 * 2)(*settings),
            )
        )
    return linears


@dataclass(frozen=True)
class LayerShape:
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float  # attention's
    sliding_window: int | None


@dataclass(frozen=True)
class GemmaNorms:
    """Gemma 3's norms beyond Llama's, each its 1 + weight: per head of q and of k, and on the
    attention's and the MLP's outputs."""

    q: torch.Tensor
    k: torch.Tensor
    post_attention: torch.Tensor
    post_mlp: torch.Tensor


class DecodeLayer:
    """One layer's weights and KV cache, as `quant_decode_layer` reads them."""

    def __init__(
        self,
        linears: tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight, QuantizedWeight],
        norms: tuple[torch.Tensor, torch.Tensor],
        shape: LayerShape,
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        gemma: GemmaNorms | None = None,
    ):
        qkv, o, gate_up, down = linears
        self.shape = shape
        extra = () if gemma is None else (gemma.q, gemma.k, gemma.post_attention, gemma.post_mlp)
        # Kept alive: the structure points into them.
        self._tensors = tuple(t.detach().contiguous() for t in (*norms, cos_sin, *kv_cache, *extra))
        norm1, norm2, table, key_cache, value_cache = self._tensors[:5]
        qkv_runs = _linears(qkv)
        self.struct = _Layer(
            (_Linear * QKV_RUNS)(*qkv_runs), len(qkv_runs),
            *(_linears(w)[0] for w in (o, gate_up, down)),
            norm1.data_ptr(), norm2.data_ptr(), shape.eps, shape.scale,
            shape.heads, shape.kv_heads, shape.head_dim,
            table.data_ptr(), table.shape[0],
            key_cache.data_ptr(), value_cache.data_ptr(), key_cache.shape[1],
            gemma is not None, C_FORMATS[key_cache.dtype],
            *(t.data_ptr() for t in self._tensors[5:]),
        )  # fmt: skip


class DecodeStep:
    """A step's tokens for every layer of one sliding window; None from `of` where the step is
    not one-token sequences only."""

    def __init__(self, struct: _Step, tensors: tuple[torch.Tensor, ...]):
        self.struct = struct
        self._tensors = tensors

    @classmethod
    def of(
        cls, meta: AttentionMetadata, positions: torch.Tensor, window: int | None
    ) -> DecodeStep | None:
        rows = decode_rows(meta, window)
        if rows is None:
            return None
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        struct = _Step(
            positions.numel(), positions.data_ptr(), slots.data_ptr(),
            rows.tables.data_ptr(), rows.tables.shape[1],
            rows.token_rows.data_ptr(), rows.table_rows.data_ptr(),
            rows.first_keys.data_ptr(), rows.seq_lens.data_ptr(),
            rows.token_rows.numel(), torch.get_num_threads(),
            quant_linear.small_batch(),
        )  # fmt: skip
        tensors = (positions, slots, rows.tables, rows.token_rows, rows.table_rows)
        return cls(struct, (*tensors, rows.first_keys, rows.seq_lens))


def run_layer(
    layer: DecodeLayer,
    step: DecodeStep,
    x: torch.Tensor,
    residual: torch.Tensor,
    has_residual: bool,
) -> None:
    """The layer on x `[tokens, hidden]` (float32, contiguous), overwritten with its output;
    `residual` (the same shape) becomes x + residual (x alone without `has_residual`) plus the
    attention's output: the residual stream the next layer adds to."""
    lib = native.library()
    if lib is None:
        raise RuntimeError("the fused decode layer needs the C kernels")
    status = lib.quant_decode_layer(
        ctypes.byref(layer.struct), ctypes.byref(step.struct),
        x.data_ptr(), residual.data_ptr(), int(has_residual), x.data_ptr(),
    )  # fmt: skip
    if status == -1:
        raise IndexError("a position is past the rotary table")
    if status == -2:
        raise MemoryError("the fused decode layer could not allocate its scratch")
    if status != 0:
        raise ValueError("the C kernels do not read this layer's weight format")

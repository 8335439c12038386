"""The many-row products of one SmolLM2-135M Q4_1 decode step of `--rows` sequences (or a
prefill of as many tokens), each of quant_gemm.c's paths against the float32 tiles (oneDNN's
GEMM on weights dequantized a tile at a time), torch's float32 GEMM on already dequantized
weights, exact mode's (oneDNN on weights reordered at load) and the few-row kernels that stream
the blocks (float32 and int16 activations): per linear, one thread's CPU time (best of
`--repeats`; CPU time, not wall time, because the shared machine is loaded).

    python benchmarks/quant_gemm_step.py --rows 128

Weights are random blocks (every bit pattern, float16 scales of a weight's size): the products'
cost does not depend on the values. Prints one JSON object: milliseconds per linear and per step
(30 layers' q/k/v, o, gate/up and down, plus the tied LM head once).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np
import torch

from pagedbatch.kernels import native, quant_gemm, quant_linear
from pagedbatch.kernels.quant_blocks import Format, dequantize

LAYERS = 30
# SmolLM2-135M's linears: (name, rows, cols, format, calls a step).
LINEARS = [
    ("qkv", 960, 576, Format.Q4_1, LAYERS),
    ("o", 576, 576, Format.Q4_1, LAYERS),
    ("gate_up", 3072, 576, Format.Q4_1, LAYERS),
    ("down", 576, 1536, Format.Q4_1, LAYERS),
    ("lm_head", 49152, 576, Format.Q8_0, 1),
]
HALVES = {Format.Q4_1: (0, 2), Format.Q8_0: (0,)}


def random_blocks(fmt: Format, rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // fmt.size, fmt.block_bytes), dtype=np.uint8)
    for at in HALVES[fmt]:
        half = rng.uniform(-0.05, 0.05, (rows, cols // fmt.size, 1)).astype(np.float16)
        raw[..., at : at + 2] = half.view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def cpu_ms(call, arguments: tuple, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        call(*arguments)
        best = min(best, time.thread_time() - start)
    return best * 1e3


def methods() -> dict[str, object]:
    lib = native.library()
    found: dict[str, object] = {
        "tiles": lambda x, b, f, c, w: quant_linear._tiles(lib, x, b, f, c),
        "torch_float32": lambda x, b, f, c, w: x @ w.T,
        # exact mode's product: oneDNN on weights reordered once at load
        "packed_float32": lambda x, b, f, c, w: torch.ops.mkldnn._linear_pointwise(
            x, packed_weight(w, x.shape[0]), None, "none", [], ""
        ),
    }
    for activations in ("float32", "int16"):  # the few-row kernels, streaming the blocks
        found[f"streamed_{activations}"] = lambda x, b, f, c, w, a=activations: (
            quant_linear._small_batch(lib, x, b, f, c, a)
        )
    for path in ("amx", "avx512"):
        if path in quant_gemm.paths():
            for product in ("bf16x3", "bf16"):
                found[f"{path}_{product}"] = lambda x, b, f, c, w, p=path, q=product: (
                    quant_gemm.multiply(x, b, f, c, q, p)
                )
    if "vnni" in quant_gemm.integer_paths():
        for bits in (16, 8):
            found[f"vnni_int{bits}"] = functools.partial(_integer, bits=bits)
    return found


def _integer(x, blocks, fmt, cols, weights, bits: int) -> torch.Tensor:
    return quant_gemm.quant_gemm_int(x, blocks, fmt, cols, bits, "vnni")


@functools.cache
def packed_weight(weights: torch.Tensor, rows: int) -> torch.Tensor:
    """The weights in oneDNN's blocked layout for `rows` rows, reordered on first use (as exact
    mode's `parallel_layers.Packed` is at load; the best of the repeats leaves that call out).
    Tensors hash by identity: one reorder per linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weights, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="these methods alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    found = methods()
    names = args.only or list(found)
    result: dict[str, dict[str, float]] = {name: {} for name in names}
    for i, (linear, rows, cols, fmt, _) in enumerate(LINEARS):
        blocks = random_blocks(fmt, rows, cols, seed=i)
        weights = dequantize(blocks.numpy(), fmt).float()
        x = torch.randn(args.rows, cols, generator=torch.Generator().manual_seed(i))
        for name in names:
            arguments = (x, blocks, fmt, cols, weights)
            result[name][linear] = round(cpu_ms(found[name], arguments, args.repeats), 3)
    for name in names:
        per = result[name]
        per["step"] = round(sum(per[linear] * calls for linear, *_, calls in LINEARS), 1)
    print(json.dumps({"rows": args.rows, "cpu_ms_one_thread": result}, indent=1))


if __name__ == "__main__":
    main()

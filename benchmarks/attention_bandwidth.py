"""Achieved memory bandwidth of our paged decode attention: the Triton kernel on CUDA, the C kernel
(`kernels/cpu_attention.c`, float32) on the CPU.

    python benchmarks/attention_bandwidth.py                       # 64 sequences of 2048 tokens
    python benchmarks/attention_bandwidth.py --batch 256 --context 4096 --dtype float16
    python benchmarks/attention_bandwidth.py --device cpu --batch 128 --context 400 \\
        --num-heads 12 --num-kv-heads 4 --head-dim 64 --layers 12   # small's decode at 128
    python benchmarks/attention_bandwidth.py --kv-cache-dtype int8  # a quantized cache

A decode step reads every cached key and value of every sequence once, and little else, so its
speed is bound by memory bandwidth. Prints one JSON line:
- kv_bytes: bytes of K and V the batch attends per layer (sequences x context x KV heads x
  head_dim x 2 x element size; with --kv-cache-dtype int8 or fp8 one byte an element plus each
  row's 4-byte scale); the kernel reads each once.
- kernel_ms, kernel_gbps: mean wall-clock time per call over --iters calls (a layer's call; on
  CUDA the device synchronized before and after them), and kv_bytes over it.
- torch_ms, torch_gbps: the same for the torch path (gather, then SDPA), for comparison.
- reference_gbps: what this device reaches in practice: on CUDA a device-to-device copy of 1 GiB
  (bytes read plus written over its time), on the CPU the best of five sums over 1 GiB (bytes read);
  fraction_of_reference is kernel_gbps over it.
- max_abs_diff: the largest difference between the two paths' outputs (a sanity check).
The cache's blocks are shuffled, as a pool hands them out after some churn. With --layers N the
calls go round N caches of the batch's size, as a model's layers do: on the CPU one cache alone
would stay in the processor's caches and time those, not memory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch
from harness import measure_read_gbps, print_report

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if any")
    p.add_argument("--batch", type=int, default=64, help="sequences, one query token each")
    p.add_argument("--context", type=int, default=2048, help="cached tokens per sequence")
    # Defaults: the `medium` make-model size (hidden 1536, 12 heads, 4 KV heads).
    p.add_argument("--num-heads", type=int, default=12)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on CUDA, else float32")
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "int8", "fp8"],
        default="auto",
        help="the cache's storage, as the engine's kv_cache_dtype: auto is --dtype",
    )
    p.add_argument("--layers", type=int, default=1, help="caches the calls go round")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sliding-window", type=int, default=None)
    return p.parse_args()


class Timer:
    """Mean milliseconds per call, after warm-up calls (which also compile or build the kernel);
    on CUDA the device is synchronized around the timed calls."""

    def __init__(self, device: torch.device, iters: int):
        self.cuda = device.type == "cuda"
        self.iters = iters

    def __call__(self, fn: Callable[[int], object]) -> float:
        for i in range(3):
            fn(i)
        if self.cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(self.iters):
            fn(i)
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3 / self.iters


def reference_gbps(device: torch.device, timer: Timer) -> float:
    if device.type == "cpu":
        return measure_read_gbps(reps=5)
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timer(lambda _: dst.copy_(src)) / 1e6


def main() -> None:
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda, and this machine has none (torch.cuda.is_available() is False)")
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if device.type == "cpu" and dtype_name != "float32":
        sys.exit("on the CPU the C kernel takes float32 alone")
    dtype = DTYPES[dtype_name]
    from pagedbatch.kernels import attention, kv_quant, native
    from pagedbatch.kernels.attention import prepare_attention

    if device.type == "cuda":  # the Triton kernels need triton, which only CUDA machines must have
        from pagedbatch.kernels import triton_attention

        kernel_name, kernel = "triton", triton_attention.paged_attention
    else:
        if native.library() is None:
            sys.exit("the C kernels could not be built (see the warning above)")
        kernel_name, kernel = "c", attention.paged_attention

    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    stored = kv_quant.storage_dtype(args.kv_cache_dtype, dtype)

    def cache() -> kv_quant.KVCacheTensor:
        values = torch.randn(shape, generator=gen, device=device)
        if stored == dtype:
            return values.to(dtype)
        return kv_quant.QuantizedCache(*kv_quant.quantize(values, stored))

    caches = [(cache(), cache()) for _ in range(args.layers)]
    block_ids = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = block_ids.view(args.batch, blocks_per_seq).to(torch.int32)
    query = torch.randn(args.batch, args.num_heads, args.head_dim, generator=gen, device=device)
    query = query.to(dtype)
    meta = prepare_attention(
        torch.arange(args.batch + 1, device=device),
        torch.full((args.batch,), args.context, device=device),
        block_tables,
        args.block_size,
    )
    scale = args.head_dim**-0.5

    def call(fn: Callable[..., torch.Tensor]) -> Callable[[int], torch.Tensor]:
        def run(i: int) -> torch.Tensor:
            key_cache, value_cache = caches[i % args.layers]
            return fn(query, key_cache, value_cache, meta, scale, args.sliding_window)

        return run

    @contextlib.contextmanager
    def torch_path() -> Iterator[None]:
        """The torch path: what runs where the C kernels are off (on CUDA, always)."""
        os.environ[native.SETTING] = "0"
        native.library.cache_clear()
        try:
            yield
        finally:
            del os.environ[native.SETTING]
            native.library.cache_clear()

    timer = Timer(device, args.iters)
    with torch_path():
        expected = call(attention.paged_attention)(0)
        torch_ms = timer(call(attention.paged_attention))
    diff = (call(kernel)(0).float() - expected.float()).abs().max().item()
    kernel_ms = timer(call(kernel))
    attended = min(args.context, args.sliding_window or args.context)
    row_bytes = kv_quant.bytes_per_row(stored, args.head_dim)
    kv_bytes = 2 * args.batch * attended * args.num_kv_heads * row_bytes
    reference = reference_gbps(device, timer)
    kernel_gbps = kv_bytes / kernel_ms / 1e6
    figures = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "kernel": kernel_name,
        "dtype": dtype_name,
        "kv_cache_dtype": kv_quant.dtype_name(stored),
        "batch": args.batch,
        "context": args.context,
        "sliding_window": args.sliding_window,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "layers": args.layers,
        "kv_bytes": kv_bytes,
        "kernel_ms": round(kernel_ms, 4),
        "kernel_gbps": round(kernel_gbps, 1),
        "torch_ms": round(torch_ms, 4),
        "torch_gbps": round(kv_bytes / torch_ms / 1e6, 1),
        "reference_gbps": round(reference, 1),
        "fraction_of_reference": round(kernel_gbps / reference, 3),
        "max_abs_diff": diff,
    }
    print_report(figures)


if __name__ == "__main__":
    main()

"""Achieved memory bandwidth of our Triton paged attention on a decode batch (CUDA only).

    python benchmarks/attention_bandwidth.py                       # 64 sequences of 2048 tokens
    python benchmarks/attention_bandwidth.py --batch 256 --context 4096 --dtype float16

A decode step reads every cached key and value of every sequence once, and little else, so its
speed is bound by memory bandwidth. Prints one JSON line:
- kv_bytes: bytes of K and V the batch attends (sequences x context x KV heads x head_dim x 2 x
  element size); the kernel reads each once.
- triton_ms, triton_gbps: mean time per call over --iters calls (CUDA events), and kv_bytes over it.
- torch_ms, torch_gbps: the same for the torch path (gather, then SDPA), for comparison.
- copy_gbps: a device-to-device copy of 1 GiB (bytes read plus written over its time), the
  bandwidth this device reaches in practice; fraction_of_copy is triton_gbps over it.
- max_abs_diff: the largest difference between the two paths' outputs (a sanity check).
The cache's blocks are shuffled, as a pool hands them out after some churn.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
from harness import print_report

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64, help="sequences, one query token each")
    p.add_argument("--context", type=int, default=2048, help="cached tokens per sequence")
    # Defaults: the `medium` make-model size (hidden 1536, 12 heads, 4 KV heads).
    p.add_argument("--num-heads", type=int, default=12)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sliding-window", type=int, default=None)
    return p.parse_args()


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean milliseconds per call, after warm-up calls (which also compile the kernel)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_gbps(iters: int) -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() / ms / 1e6


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "attention_bandwidth.py times the Triton kernel on a CUDA device, and this machine "
            "has none (torch.cuda.is_available() is False)"
        )
    # Imported here: the Triton kernels need triton, which only the CUDA machines must have.
    from pagedbatch.kernels import attention, triton_attention
    from pagedbatch.kernels.attention import prepare_attention

    dtype = DTYPES[args.dtype]
    device = torch.device("cuda")
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    key_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    value_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    block_ids = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = block_ids.view(args.batch, blocks_per_seq).to(torch.int32)
    query = torch.randn(args.batch, args.num_heads, args.head_dim, generator=gen, device=device).to(
        dtype
    )
    meta = prepare_attention(
        torch.arange(args.batch + 1, device=device),
        torch.full((args.batch,), args.context, device=device),
        block_tables,
        args.block_size,
    )
    scale = args.head_dim**-0.5
    call = (query, key_cache, value_cache, meta, scale, args.sliding_window)

    def run_triton() -> torch.Tensor:
        return triton_attention.paged_attention(*call)

    def run_torch() -> torch.Tensor:
        return attention.paged_attention(*call)

    diff = (run_triton().float() - run_torch().float()).abs().max().item()
    attended = min(args.context, args.sliding_window or args.context)
    kv_bytes = 2 * args.batch * attended * args.num_kv_heads * args.head_dim * dtype.itemsize
    triton_ms = time_ms(run_triton, args.iters)
    torch_ms = time_ms(run_torch, args.iters)
    copy = copy_gbps(args.iters)
    triton_gbps = kv_bytes / triton_ms / 1e6
    figures = {
        "device": torch.cuda.get_device_name(device),
        "dtype": args.dtype,
        "batch": args.batch,
        "context": args.context,
        "sliding_window": args.sliding_window,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "kv_bytes": kv_bytes,
        "triton_ms": round(triton_ms, 4),
        "triton_gbps": round(triton_gbps, 1),
        "torch_ms": round(torch_ms, 4),
        "torch_gbps": round(kv_bytes / torch_ms / 1e6, 1),
        "copy_gbps": round(copy, 1),
        "fraction_of_copy": round(triton_gbps / copy, 3),
        "max_abs_diff": diff,
    }
    print_report(figures)


if __name__ == "__main__":
    main()

"""Greedy parity of our engine with transformers, on one device, per architecture and dtype.

    python scripts/gpu_check/parity.py --device cuda --size small --work /tmp/parity

Each `pagedbatch make-model` checkpoint (built here: nothing is downloaded) runs random prompts
greedily through our engine and through transformers' `generate`, both on `--device` in the
same dtype. Transformers in float32 scores each engine's tokens, fed them (teacher forcing): a
token's gap is how far its logit falls below the best. float32 must give the same tokens, but
for a flip between logits tied to within FLOAT32_LOGIT_GAP. bfloat16 rounds differently in the
two (their kernels sum in other orders), so a late divergence between near-equal logits is no
bug: there, ours may fall no further below float32's best than BF16_LOGIT_GAP, or twice what
transformers' own bfloat16 tokens do, whichever is more; a wrong kernel lands far outside that.
Prints one JSON line of figures; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch
from greedy_checks import random_prompts
from harness import print_report
from transformers import AutoModelForCausalLM

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.config import DTYPES
from pagedbatch.engine.worker.model_runner import native_bfloat16
from pagedbatch.make_model import make_model

# float32 sums in another order (cuBLAS and our kernels against transformers' own) differ in the
# last bits: a token may flip where two logits tie that closely, and nowhere else.
FLOAT32_LOGIT_GAP = 1e-5
# How far below float32's best logit a bfloat16 choice may always score, relative to the row's
# largest logit magnitude: a bfloat16 forward pass carries relative errors of about 2^-8 per
# rounding (the `small` llama's tokens fell up to 0.013 below on the CPU).
BF16_LOGIT_GAP = 0.03


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--archs", default="llama,qwen2")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--size", default="small", help="make-model size")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--work", type=Path, required=True, help="where the checkpoints are built")
    p.add_argument("--no-cuda-graphs", action="store_true", help="our decode steps run eagerly")
    return p.parse_args()


def hf_model(model_dir: Path, dtype: torch.dtype, device: str) -> Any:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # every request runs to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def worst_gap(model: Any, prompt: list[int], tokens: list[int]) -> float:
    """The largest shortfall of our tokens' logits below the best, each over its row's largest
    magnitude, with `model` fed prompt + our tokens."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens, device=model.device)[:, None])[:, 0]
    gaps = (logits.max(dim=1).values - chosen) / logits.abs().max(dim=1).values
    return gaps.max().item()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ours(model_dir: Path, dtype: str, args: argparse.Namespace, prompts: list[list[int]]) -> list:
    # A KV cache of its own size: by default a CUDA engine takes most of the free memory, and
    # transformers' copy of the model comes next.
    llm = LLM(
        model_dir,
        device=args.device,
        dtype=dtype,
        kv_cache_memory_gib=0.25,
        cuda_graphs=not args.no_cuda_graphs,
    )
    n = args.max_tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outputs = [list(out.token_ids) for out in llm.generate(prompts, greedy)]
    llm.shutdown()
    return outputs


def check(model_dir: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    prompts = random_prompts(args.prompts, 4, 40)
    our_tokens = ours(model_dir, dtype, args, prompts)
    model = hf_model(model_dir, DTYPES[dtype], args.device)
    theirs = [hf_greedy(model, prompt, args.max_tokens) for prompt in prompts]
    pairs = list(zip(our_tokens, theirs, strict=True))
    figures: dict[str, Any] = {
        "identical_requests": sum(a == b for a, b in pairs),
        "requests": len(pairs),
        "matching_prefix_tokens": round(
            sum(common_prefix(a, b) for a, b in pairs) / sum(len(a) for a, _ in pairs), 4
        ),
    }
    if dtype != "float32":
        del model
        model = hf_model(model_dir, torch.float32, args.device)
    gap, hf_gap = (
        max(worst_gap(model, *pair) for pair in zip(prompts, tokens, strict=True))
        for tokens in (our_tokens, theirs)
    )
    figures.update(worst_logit_gap=round(gap, 6), transformers_worst_logit_gap=round(hf_gap, 6))
    if dtype == "float32":
        figures["ok"] = figures["identical_requests"] == len(pairs) or gap <= FLOAT32_LOGIT_GAP
    else:
        figures["ok"] = gap <= max(BF16_LOGIT_GAP, 2 * hf_gap)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    figures["seconds"] = round(time.perf_counter() - started, 1)
    return figures


def main() -> None:
    args = parse_args()
    results: dict[str, Any] = {
        "device": args.device,
        "size": args.size,
        "cuda_graphs": not args.no_cuda_graphs,
    }
    for arch in args.archs.split(","):
        model_dir = make_model(args.work / f"{arch}-{args.size}", arch=arch, size=args.size)
        for dtype in args.dtypes.split(","):
            if dtype == "bfloat16" and args.device == "cpu" and not native_bfloat16():
                # The engine refuses bfloat16 on such a CPU at start (model_runner.resolve_dtype).
                results[f"{arch}/{dtype}"] = "skipped: this CPU has no native bfloat16"
                continue
            results[f"{arch}/{dtype}"] = check(model_dir, dtype, args)
    # SmolLM2's GGUF (98 MB) is over what a device call carries (64 MiB), and the device
    # machine has no network to fetch it: the make-model checkpoints stand in for it.
    results["smollm2"] = "skipped: its 98 MB GGUF is over the 64 MiB a device call carries"
    results["ok"] = all(v["ok"] for v in results.values() if isinstance(v, dict))
    print_report(results)
    sys.exit(0 if results["ok"] else 1)


if __name__ == "__main__":
    main()

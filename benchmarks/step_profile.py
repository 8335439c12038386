"""Where an engine step's time goes: matmuls, attention, norms, rotary, activations, the LM head,
sampling, and the engine's own bookkeeping, per scenario.

    python benchmarks/step_profile.py                       # small llama; ~3 min
    python benchmarks/step_profile.py --model SmolLM2-135M-Instruct.Q4_1.gguf   # a GGUF or a dir
    python benchmarks/step_profile.py --model SmolLM2-135M-Instruct.Q4_1.gguf --quantization gguf \
        --decode 1 --prompt-len 64 --no-prefill      # one request's decode step on the blocks

Each part is timed by wrapping the function that does it (on the CPU every call is synchronous,
so a wall-clock timer around it is exact; the wrappers cost about a microsecond a call):
- matmul: the linears' products (`parallel_layers.Packed` calls and `F.linear`), the LM head's
  excepted (it counts as lm_head);
- attention: `ops.paged_attention` (K/V gathers, SDPA, the scatter back) and `ops.reshape_and_cache`
  (writing the step's K/V);
- norms, rotary, activation: `ops.rms_norm`/`fused_add_rms_norm`, `ops.apply_rotary_embedding`,
  `ops.silu_and_mul`;
- fused_layers: the decoder layers that run in one C call each (`decode_layer.c`: a decode step
  on quantized weights), everything in them, matmuls and attention included;
- lm_head: `compute_logits`; sampling: the core's `_sample`;
- model_other: the rest of `ModelRunner.run` (embedding lookup, attention metadata, views, copies);
- engine_other: the rest of `step()` (scheduling, block tables, batch building, detokenizing,
  stop checks, outputs, telemetry).

Scenarios (each a fresh engine, as many sequences as it says, all in the batch at once):
- decode-N: N running sequences of `--prompt-len` prompt tokens, steps of one token each;
- prefill: 64 prompts of 512 tokens arriving together, steps of `max_num_batched_tokens` tokens
  (timed until every prompt has its first token).
Prints one JSON line: per scenario, the median step in ms and each part's share of the steps' sum,
and how far the two big parts are from the machine's limits, measured in the same run (the GEMM
peak of harness.measure_gemm_peak, the read bandwidth of harness.measure_read_gbps):
- work_per_step: the matmuls' and the LM head's GFLOP (2 x rows x inputs x outputs), attention's
  GB of K/V read (each sequence's attended context once per layer) and its GFLOP (QK and PV);
- achieved: the matmuls' and LM head's GFLOP/s, attention's GB/s;
- floor_ms: the step's mean if matmuls and the LM head ran at the GEMM peak and attention at the
  read bandwidth (or the peak, where its FLOPs take longer), every other part as measured (and
  a part that already runs faster than that as measured); and
  speedup_at_limits, the mean step over it: what perfect kernels for those parts could give.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from harness import ensure_model, log, measure_gemm_peak, measure_read_gbps, print_report

from pagedbatch.engine import LLMEngine, SamplingParams
from pagedbatch.engine.config import EngineArgs
from pagedbatch.engine.worker import parallel_layers
from pagedbatch.engine.worker.models import llama
from pagedbatch.kernels import ops

PARTS = (
    "fused_layers",
    "matmul",
    "attention",
    "norms",
    "rotary",
    "activation",
    "lm_head",
    "sampling",
    "model_other",
    "engine_other",
)


@dataclass
class Work:
    """What a part computed over the timed steps."""

    flops: float = 0.0
    bytes_read: float = 0.0  # counted for attention alone, whose speed bytes bound


# A part's work in one call, from the call's arguments and its result: (flops, bytes read).
Counter = Callable[[tuple[Any, ...], dict[str, Any], Any], tuple[float, float]]


class Timers:
    """Seconds and work per part, over the timed steps. A part called inside another (the LM
    head's matmul) counts for the outer one; `run`, the model runner's whole step, contains the
    others and is timed beside them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.work: dict[str, Work] = defaultdict(Work)
        self.active = False
        self.inside: str | None = None

    def wrap(
        self, part: str, fn: Callable[..., Any], count: Counter | None = None
    ) -> Callable[..., Any]:
        container = part == "run"

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active or (self.inside is not None and not container):
                return fn(*args, **kwargs)
            if not container:
                self.inside = part
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                if not container:
                    self.inside = None
            if count:
                flops, bytes_read = count(args, kwargs, result)
                self.work[part].flops += flops
                self.work[part].bytes_read += bytes_read
            return result

        return timed


def linear_work(args: tuple[Any, ...], _: dict[str, Any], out: torch.Tensor) -> tuple[float, float]:
    """A product of [rows, inputs] by [inputs, outputs]: 2 x rows x inputs x outputs."""
    x = next(a for a in args if isinstance(a, torch.Tensor))  # the input comes first
    return 2.0 * x.numel() * out.shape[-1], 0.0


ATTENTION = inspect.signature(ops.paged_attention)


class AttentionWork:
    """Counts `ops.paged_attention`'s work: each sequence's attended keys and values are read
    once; each query token attends the keys before it (within the window), at 4 x head_dim FLOPs
    a head and key (QK and PV). Every layer of a step passes the same metadata, and the counting
    runs inside the timed step, so a step's keys are counted once, not once a layer."""

    def __init__(self) -> None:
        self._step: tuple[object, int | None] | None = None  # (metadata, window) counted last
        self._keys = (0, 0)  # its keys read, keys attended

    def __call__(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], _: torch.Tensor
    ) -> tuple[float, float]:
        call = ATTENTION.bind(*args, **kwargs)
        call.apply_defaults()
        query, key_cache, meta = (call.arguments[k] for k in ("query", "key_cache", "meta"))
        window = call.arguments["sliding_window"]
        if self._step is None or self._step[0] is not meta or self._step[1] != window:
            self._step, self._keys = (meta, window), _count_keys(meta, window)
        keys_read, keys_attended = self._keys
        num_heads, head_dim = query.shape[1:]
        row_bytes = 2 * key_cache.shape[2] * head_dim * key_cache.element_size()
        return 4.0 * num_heads * head_dim * keys_attended, float(keys_read * row_bytes)


def _count_keys(meta: Any, window: int | None) -> tuple[int, int]:
    """Keys read (each sequence's attended span once) and keys attended (summed over queries)."""
    query_lens = [b - a for a, b in itertools.pairwise(meta.query_start_loc.tolist())]
    keys_read = keys_attended = 0
    for q, seq_len in zip(query_lens, meta.seq_lens.tolist(), strict=True):
        keys_read += min(seq_len, window + q - 1) if window else seq_len
        first = seq_len - q + 1  # keys the step's first query token attends, before the window
        if window is None:
            keys_attended += q * first + q * (q - 1) // 2
        else:  # the first `unclipped` queries see fewer keys than the window holds
            unclipped = max(0, min(q, window - first + 1))
            keys_attended += unclipped * first + unclipped * (unclipped - 1) // 2
            keys_attended += (q - unclipped) * window
    return keys_read, keys_attended


@contextlib.contextmanager
def instrumented(engine: LLMEngine, timers: Timers) -> Iterator[None]:
    """Wraps the parts' functions for the engine's lifetime (module attributes, restored after)."""
    patches: list[tuple[Any, str, str, Counter | None]] = [
        (ops, "paged_attention", "attention", AttentionWork()),
        (ops, "reshape_and_cache", "attention", None),
        (ops, "rms_norm", "norms", None),
        (ops, "fused_add_rms_norm", "norms", None),
        (ops, "apply_rotary_embedding", "rotary", None),
        (ops, "silu_and_mul", "activation", None),
        (parallel_layers.Packed, "__call__", "matmul", linear_work),
        (parallel_layers.QuantizedWeight, "__call__", "matmul", linear_work),
        (parallel_layers.F, "linear", "matmul", linear_work),
        (llama, "run_layer", "fused_layers", None),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _, _ in patches]
    model = engine.runner.model
    runner, core = engine.runner, engine.core
    instance_patches: list[tuple[Any, str, str, Counter | None]] = [
        (model, "compute_logits", "lm_head", linear_work),
        (runner, "run", "run", None),
        (core, "_sample", "sampling", None),
    ]
    try:
        for owner, name, part, count in patches + instance_patches:
            setattr(owner, name, timers.wrap(part, getattr(owner, name), count))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        for owner, name, _, _ in instance_patches:  # the class's method shows through again
            delattr(owner, name)


@dataclass(frozen=True)
class Limits:
    gemm_gflops: float
    read_gbps: float


def scenario(
    model: str,
    name: str,
    num_seqs: int,
    prompt_len: int,
    steps: int,
    args: argparse.Namespace,
    limits: Limits,
) -> dict[str, Any]:
    engine = LLMEngine(
        EngineArgs(
            model=model,
            dtype="float32",
            quantization=args.quantization,
            max_num_seqs=max(num_seqs, 1),
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_gib=args.kv_cache_gib,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    )
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    # Enough tokens to outlast the run, within the model's context.
    max_tokens = min(1000, engine.max_model_len - prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
        engine.add_request(str(i), prompt, params)
    prefill = name == "prefill"
    if not prefill:  # every sequence decoding: past the prefills, then a few warm steps
        while engine.get_stats()["waiting"] or any(
            not r.output_token_ids for r in engine.scheduler.running
        ):
            engine.step()
        for _ in range(3):
            engine.step()
    timers = Timers()
    step_times: list[float] = []
    with instrumented(engine, timers):
        timers.active = True
        for _ in range(steps):
            if prefill and not engine.get_stats()["waiting"]:
                break
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
    total = sum(step_times)
    seconds = dict(timers.seconds)
    run = seconds.pop("run", 0.0)
    inside_run = sum(seconds.get(p, 0.0) for p in PARTS if p not in ("sampling", "engine_other"))
    seconds["model_other"] = run - inside_run
    seconds["engine_other"] = total - run - seconds.get("sampling", 0.0)
    engine.shutdown()
    n = len(step_times)
    return {
        "sequences": num_seqs,
        "prompt_len": prompt_len,
        "steps": n,
        "step_ms_median": round(statistics.median(step_times) * 1000, 2),
        "share": {p: round(seconds.get(p, 0.0) / total, 4) for p in PARTS},
        "ms_per_step": {p: round(seconds.get(p, 0.0) / n * 1000, 2) for p in PARTS},
        **against_limits(timers.work, seconds, total, n, limits),
    }


def against_limits(
    work: dict[str, Work], seconds: dict[str, float], total: float, steps: int, limits: Limits
) -> dict[str, Any]:
    """The matmuls', LM head's and attention's work per step, their speed, and the step's mean
    had they run at the machine's limits (the others as measured)."""
    matmul, lm_head, attention = work["matmul"], work["lm_head"], work["attention"]
    peak, bandwidth = limits.gemm_gflops * 1e9, limits.read_gbps * 1e9
    # A part already faster than the limit says (a shape the square GEMM measures poorly)
    # keeps its time.
    at_limits = {
        "matmul": matmul.flops / peak,
        "lm_head": lm_head.flops / peak,
        "attention": max(attention.bytes_read / bandwidth, attention.flops / peak),
    }
    floor = {p: min(s, seconds.get(p, 0.0)) for p, s in at_limits.items()}
    floor_s = total - sum(seconds.get(p, 0.0) for p in floor) + sum(floor.values())
    return {
        "work_per_step": {
            "matmul_gflop": round(matmul.flops / steps / 1e9, 3),
            "lm_head_gflop": round(lm_head.flops / steps / 1e9, 3),
            "attention_gb": round(attention.bytes_read / steps / 1e9, 4),
            "attention_gflop": round(attention.flops / steps / 1e9, 3),
        },
        "achieved": {
            "matmul_gflops": _rate(matmul.flops, seconds.get("matmul")),
            "lm_head_gflops": _rate(lm_head.flops, seconds.get("lm_head")),
            "attention_gbps": _rate(attention.bytes_read, seconds.get("attention")),
        },
        "step_ms_mean": round(total / steps * 1000, 2),
        "floor_ms": round(floor_s / steps * 1000, 2),
        "speedup_at_limits": round(total / floor_s, 3),
    }


def _rate(work: float, seconds: float | None) -> float | None:
    """Work per second, in billions; None for a part not timed (inside the fused layers)."""
    return round(work / seconds / 1e9, 2) if seconds else None


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="a checkpoint directory or GGUF (default: build small llama)")
    p.add_argument("--size", default="small")
    p.add_argument("--decode", default="64,128", help="running sequences of the decode scenarios")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--kv-cache-dtype", default="auto", help="as the engine's")
    p.add_argument(
        "--quantization", default="none", choices=("none", "gguf"), help="as the engine's"
    )
    p.add_argument("--no-prefill", action="store_true", help="the decode scenarios only")
    args = p.parse_args()
    if args.quantization == "gguf" and not str(args.model or "").endswith(".gguf"):
        p.error("--quantization gguf needs a GGUF --model")
    # quantization gguf reads the GGUF itself; exact mode its float32 copy.
    model = (
        str(Path(args.model).expanduser().resolve())
        if args.quantization == "gguf"
        else str(ensure_model(args.model, args.size))
    )
    torch.manual_seed(0)
    limits = Limits(gemm_gflops=measure_gemm_peak(reps=10), read_gbps=measure_read_gbps(reps=5))
    report: dict[str, Any] = {
        "model": model,
        "threads": torch.get_num_threads(),
        "gemm_peak_gflops": round(limits.gemm_gflops, 1),
        "read_gbps": round(limits.read_gbps, 1),
    }
    for n in (int(s) for s in args.decode.split(",")):
        log(f"decode-{n}")
        report[f"decode-{n}"] = scenario(
            model, f"decode-{n}", n, args.prompt_len, args.steps, args, limits
        )
    if not args.no_prefill:
        log("prefill")
        report["prefill"] = scenario(model, "prefill", 64, 512, args.steps, args, limits)
    print_report(report)


if __name__ == "__main__":
    main()

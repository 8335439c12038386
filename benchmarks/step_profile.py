"""Where an engine step's time goes: matmuls, attention, norms, rotary, activations, the LM head,
sampling, and the engine's own bookkeeping, per scenario.

    python benchmarks/step_profile.py                       # small llama; ~3 min
    python benchmarks/step_profile.py --model SmolLM2-135M-Instruct.Q4_1.gguf   # a GGUF or a dir

Each part is timed by wrapping the function that does it (on the CPU every call is synchronous,
so a wall-clock timer around it is exact; the wrappers cost about a microsecond a call):
- matmul: the linears' products (`parallel_layers.Packed` calls and `F.linear`), the LM head's
  excepted (it counts as lm_head);
- attention: `ops.paged_attention` (K/V gathers, SDPA, the scatter back) and `ops.reshape_and_cache`
  (writing the step's K/V);
- norms, rotary, activation: `ops.rms_norm`/`fused_add_rms_norm`, `ops.apply_rotary_embedding`,
  `ops.silu_and_mul`;
- lm_head: `compute_logits`; sampling: the core's `_sample`;
- model_other: the rest of `ModelRunner.run` (embedding lookup, attention metadata, views, copies);
- engine_other: the rest of `step()` (scheduling, block tables, batch building, detokenizing,
  stop checks, outputs, telemetry).

Scenarios (each a fresh engine, as many sequences as it says, all in the batch at once):
- decode-N: N running sequences of `--prompt-len` prompt tokens, steps of one token each;
- prefill: 64 prompts of 512 tokens arriving together, steps of `max_num_batched_tokens` tokens
  (timed until every prompt has its first token).
Prints one JSON line: per scenario, the median step in ms and each part's share of the steps' sum.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from harness import ensure_model, log, print_report

from pagedbatch.engine import LLMEngine, SamplingParams, parallel_layers
from pagedbatch.engine.config import EngineArgs
from pagedbatch.kernels import ops

PARTS = (
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


class Timers:
    """Seconds per part, over the timed steps. A part called inside another (the LM head's
    matmul) counts for the outer one; `run`, the model runner's whole step, contains the others
    and is timed beside them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False
        self.inside: str | None = None

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        container = part == "run"

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active or (self.inside is not None and not container):
                return fn(*args, **kwargs)
            if not container:
                self.inside = part
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                if not container:
                    self.inside = None

        return timed


@contextlib.contextmanager
def instrumented(engine: LLMEngine, timers: Timers) -> Iterator[None]:
    """Wraps the parts' functions for the engine's lifetime (module attributes, restored after)."""
    patches = [
        (ops, "paged_attention", "attention"),
        (ops, "reshape_and_cache", "attention"),
        (ops, "rms_norm", "norms"),
        (ops, "fused_add_rms_norm", "norms"),
        (ops, "apply_rotary_embedding", "rotary"),
        (ops, "silu_and_mul", "activation"),
        (parallel_layers.Packed, "__call__", "matmul"),
        (parallel_layers.F, "linear", "matmul"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    model = engine.runner.model
    runner, core = engine.runner, engine.core
    instance_patches = [
        (model, "compute_logits", "lm_head"),
        (runner, "run", "run"),
        (core, "_sample", "sampling"),
    ]
    try:
        for owner, name, part in patches:
            setattr(owner, name, timers.wrap(part, getattr(owner, name)))
        for owner, name, part in instance_patches:
            setattr(owner, name, timers.wrap(part, getattr(owner, name)))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        for owner, name, _ in instance_patches:  # the class's method shows through again
            delattr(owner, name)


def scenario(
    model: str, name: str, num_seqs: int, prompt_len: int, steps: int, args: argparse.Namespace
) -> dict[str, Any]:
    engine = LLMEngine(
        EngineArgs(
            model=model,
            dtype="float32",
            max_num_seqs=max(num_seqs, 1),
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_gib=args.kv_cache_gib,
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
    return {
        "sequences": num_seqs,
        "prompt_len": prompt_len,
        "steps": len(step_times),
        "step_ms_median": round(statistics.median(step_times) * 1000, 2),
        "share": {p: round(seconds.get(p, 0.0) / total, 4) for p in PARTS},
        "ms_per_step": {p: round(seconds.get(p, 0.0) / len(step_times) * 1000, 2) for p in PARTS},
    }


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
    args = p.parse_args()
    model = str(ensure_model(args.model, args.size))
    torch.manual_seed(0)
    report: dict[str, Any] = {"model": model, "threads": torch.get_num_threads()}
    for n in (int(s) for s in args.decode.split(",")):
        log(f"decode-{n}")
        report[f"decode-{n}"] = scenario(model, f"decode-{n}", n, args.prompt_len, args.steps, args)
    log("prefill")
    report["prefill"] = scenario(model, "prefill", 64, 512, args.steps, args)
    print_report(report)


if __name__ == "__main__":
    main()

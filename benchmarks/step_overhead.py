"""Per-step engine overhead: a decode step's wall time less the time spent in the model.

    OMP_NUM_THREADS=1 python benchmarks/step_overhead.py            # 8 scenarios, ~6 min
    OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --requests 64 --prompt-lens 32
    OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --output-kind cumulative

A tiny random-weight Llama (`pagedbatch.make_model`, made in a temporary directory) keeps the
forward pass short, so what the engine does around it (scheduling, block tables, batch
building, sampling, detokenizing, stop checks, outputs, telemetry) shows. Each scenario builds a
fresh `LLMEngine` with room for every request at once (`max_num_seqs` >= 256, a KV cache large
enough that nothing is preempted), adds `requests` requests of `prompt_len` random tokens
(ignore_eos, enough max_tokens to outlast the run), steps until every one of them has its first
token, runs `--warmup-steps` more decode steps, then times `--steps` steps.

Figures per scenario, medians over the timed steps, in milliseconds:
- step_ms: `engine.step()` wall time.
- forward_ms: time inside the model's `forward` and `compute_logits` (wrapped with a timer here
  only; nothing is synchronised, which on CPU is exact).
- overhead_ms: step_ms - forward_ms, per step, then the median; overhead_ms_min, the smallest
  (on a shared machine other processes only ever add to a step).

`sampling` is `greedy` (argmax, the sampler's fast path) or `penalties` (temperature, top-p and
the repetition, presence and frequency penalties: the sampler's full path). `--output-kind` is
the requests' `SamplingParams.output_kind`: by default delta, what a stream gets (a whole
response or a batch line gets final_only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedbatch.engine import LLMEngine, SamplingParams
from pagedbatch.engine.config import EngineArgs
from pagedbatch.engine.sampling_params import RequestOutputKind
from pagedbatch.make_model import make_model

BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 2048
TOKEN_ID_RANGE = (10, 8000)  # clear of the tokenizer's special ids, which sit at the top
SAMPLINGS = {
    "greedy": {"temperature": 0.0},
    "penalties": {
        "temperature": 0.8,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
    },
}


class ForwardTimer:
    """Adds up the seconds spent in a model's forward pass and LM head."""

    def __init__(self, model: torch.nn.Module):
        self.seconds = 0.0
        # nn.Module.__call__ looks `forward` up on the instance, so this wraps every call.
        model.forward = self._timed(model.forward)
        model.compute_logits = self._timed(model.compute_logits)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


def run_scenario(
    model_dir: str, num_requests: int, prompt_len: int, sampling: str, args: argparse.Namespace
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    # Prefill takes about this many steps; the first requests decode all through it.
    prefill_steps = -(-num_requests * prompt_len // MAX_NUM_BATCHED_TOKENS)
    max_tokens = prefill_steps + args.warmup_steps + args.steps + 16
    blocks_per_request = -(-(prompt_len + max_tokens) // BLOCK_SIZE)
    engine = LLMEngine(
        EngineArgs(
            model=model_dir,
            max_num_seqs=max(256, num_requests),
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_requests * blocks_per_request + 16,
        )
    )
    timer = ForwardTimer(engine.runner.model)
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        seed=args.seed,
        output_kind=RequestOutputKind(args.output_kind),
        **SAMPLINGS[sampling],
    )
    for i in range(num_requests):
        prompt = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    running = engine.scheduler.running
    while len(running) < num_requests or any(r.num_output_tokens == 0 for r in running):
        engine.step()
    for _ in range(args.warmup_steps):
        engine.step()
    step_ms, forward_ms = [], []
    for _ in range(args.steps):
        forward_before = timer.seconds
        began = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - began) * 1e3)
        forward_ms.append((timer.seconds - forward_before) * 1e3)
        if len(running) != num_requests:
            raise RuntimeError("a request finished or was preempted inside the timed steps")
    engine.shutdown()
    overhead_ms = [s - f for s, f in zip(step_ms, forward_ms, strict=True)]
    return {
        "running": num_requests,
        "prompt_len": prompt_len,
        "sampling": sampling,
        "output_kind": args.output_kind,
        "steps": args.steps,
        "step_ms": round(statistics.median(step_ms), 3),
        "forward_ms": round(statistics.median(forward_ms), 3),
        "overhead_ms": round(statistics.median(overhead_ms), 3),
        "overhead_ms_min": round(min(overhead_ms), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default="64,256", help="running requests, comma-separated")
    parser.add_argument("--prompt-lens", default="32,1500", help="prompt tokens, comma-separated")
    parser.add_argument("--sampling", default="greedy,penalties", help=", ".join(SAMPLINGS))
    parser.add_argument(
        "--output-kind", default="delta", choices=[k.value for k in RequestOutputKind]
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    scenarios = [
        (int(n), int(length), sampling)
        for length in args.prompt_lens.split(",")
        for n in args.requests.split(",")
        for sampling in args.sampling.split(",")
    ]
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_avg_1m_start": round(os.getloadavg()[0], 2),
        },
        "scenarios": [],
    }
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as model_dir:
        make_model(model_dir, arch="llama", size="tiny")
        for num_requests, prompt_len, sampling in scenarios:
            print(f"{num_requests} x {prompt_len} tokens, {sampling}", file=sys.stderr)
            figures = run_scenario(model_dir, num_requests, prompt_len, sampling, args)
            print(f"  {figures}", file=sys.stderr)
            report["scenarios"].append(figures)
    report["machine"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""Structured output's cost: constrained against unconstrained throughput on the same workload.

    python benchmarks/structured_output.py            # small llama, 64 requests; minutes on CPU
    python benchmarks/structured_output.py --quick    # tiny model, 32 requests; seconds

The constrained run samples every request at temperature 1 under a JSON schema (a random model
writes whatever the grammar lets it). The unconstrained run then replays the same prompts and
seeds with each request's max_tokens set to the length its constrained output had, ignoring EOS:
the same batches of the same sizes for the same number of steps, without the grammar. So the
ratio of the two throughputs is what the grammar costs: compiling, filling each step's token
masks, applying them, and advancing the matchers. The pair runs `--repeats` times, alternating,
and each figure is the best of its runs: on a shared machine the worst are noise.

Figures: output tokens per second of each kind of run (`constrained_tps`, `unconstrained_tps`,
from the best of `constrained_s` and `unconstrained_s`) and their ratio (`ratio`: the target is
at least 0.8); `valid_json`, the share of constrained outputs that parse as JSON; `compile_ms`,
compiling the schema's grammar on a warm compiler; the mean and largest constrained output
lengths. The machine has two cores: benchmark it quiet, and compare only within one run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from harness import ensure_model, log, print_report

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "score": {"type": ["number", "null"], "minimum": 0, "maximum": 100},
    },
    "required": ["name", "age", "role", "active", "address", "tags", "score"],
}
# Another schema, compiled first so that `compile_ms` leaves out building the compiler.
WARMUP_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def prompts(tokenizer: Any, count: int) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe user number {i} as JSON."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for i in range(count)
    ]


def timed_generate(llm: Any, texts: list[str], params: list[Any]) -> tuple[list[Any], float]:
    started = time.perf_counter()
    outputs = llm.generate(texts, params)
    return outputs, time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pagedbatch.engine import LLM, SamplingParams
    from pagedbatch.engine.sample.structured_output import StructuredOutput

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = ensure_model(args.model, args.size, args.arch)
    llm = LLM(model_dir, max_num_seqs=args.max_num_seqs)
    structured = StructuredOutput.json_schema(SCHEMA)
    texts = prompts(llm.tokenizer, args.requests)

    grammars = llm.engine.grammars
    grammars.compile(StructuredOutput.json_schema(WARMUP_SCHEMA)).result()
    started = time.perf_counter()
    grammars.compile(structured).result()
    compile_ms = (time.perf_counter() - started) * 1000
    log("warming up")
    llm.generate(texts[:2], SamplingParams(max_tokens=8, structured=structured))

    def params(seed: int, **overrides: Any) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=args.seed + seed, **overrides)

    constrained_s, unconstrained_s = [], []
    for repeat in range(args.repeats):
        log(f"run {repeat + 1} of {args.repeats}: constrained, {args.requests} requests")
        constrained, seconds = timed_generate(
            llm,
            texts,
            [
                params(i, max_tokens=args.max_tokens, structured=structured)
                for i in range(len(texts))
            ],
        )
        constrained_s.append(seconds)
        lengths = [len(o.token_ids) for o in constrained]
        log(f"run {repeat + 1} of {args.repeats}: unconstrained, each to its constrained length")
        unconstrained, seconds = timed_generate(
            llm, texts, [params(i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
        )
        unconstrained_s.append(seconds)
        if [len(o.token_ids) for o in unconstrained] != lengths:
            raise RuntimeError("the unconstrained run did not replay the constrained lengths")
    tokens = sum(lengths)
    constrained_tps = tokens / min(constrained_s)
    unconstrained_tps = tokens / min(unconstrained_s)
    return {
        "benchmark": "structured_output",
        "model": str(model_dir),
        "requests": args.requests,
        "max_num_seqs": args.max_num_seqs,
        "torch_threads": torch.get_num_threads(),
        "output_tokens": tokens,
        "mean_output_len": round(tokens / len(lengths), 1),
        "max_output_len": max(lengths),
        "finished_by_stop": sum(o.finish_reason == "stop" for o in constrained) / len(lengths),
        "valid_json": sum(_is_json(o.text) for o in constrained) / len(lengths),
        "compile_ms": round(compile_ms, 1),
        "constrained_s": [round(t, 2) for t in constrained_s],
        "unconstrained_s": [round(t, 2) for t in unconstrained_s],
        "constrained_tps": round(constrained_tps, 1),
        "unconstrained_tps": round(unconstrained_tps, 1),
        "ratio": round(constrained_tps / unconstrained_tps, 3),
    }


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 32 requests: a smoke run")
    p.add_argument("--model", help="checkpoint directory (default: build one in ~/.cache)")
    p.add_argument("--arch", default="llama", help="architecture of the built checkpoint")
    p.add_argument("--size", help="size of the built checkpoint (default small; tiny with --quick)")
    p.add_argument("--requests", type=int, help="default 64 (32 with --quick)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=1024, help="cap of the constrained run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each; the best counts")
    p.add_argument("--threads", type=int, help="torch threads (1 on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.size = args.size or ("tiny" if args.quick else "small")
    args.requests = args.requests or (32 if args.quick else 64)
    if min(args.requests, args.max_num_seqs, args.max_tokens, args.repeats) < 1:
        p.error("--requests, --max-num-seqs, --max-tokens and --repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    print_report(run(parse_args(argv)))


if __name__ == "__main__":
    main()

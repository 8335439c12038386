"""What `kv_cache_dtype` int8 and fp8 cost in quality and buy in capacity, against auto (float32
on the CPU), on a trained model from PyPI:

    python benchmarks/kv_cache_dtype.py       # SmolLM2-135M: the whole text, 128 chats
    python benchmarks/kv_cache_dtype.py --models gemma-3-270m --chunks 16 --prompts 32

Per model and KV dtype, one JSON report:
- perplexity on the shipped text (quality.py: llama-perplexity's chunks of 512, each alone, the
  second half scored), and its ratio to auto's: the gates are 0.5% (int8) and 1% (fp8).
- agreement of the greedy answers to `--prompts` chat prompts (throughput.py's chat_prompts,
  `--max-tokens` each) with auto's (throughput.py's answers_agreement).
- blocks and concurrent sequences of `--context` tokens that `--kv-cache-memory-gib` holds (the
  engine's own arithmetic: ModelRunner.kv_bytes_per_block), and their ratio to auto's.
Each engine runs exact mode (quantization none) unless `--quantization gguf`: the difference is
the KV cache's alone. Decode attention's bytes and time are attention_bandwidth.py's
(`--kv-cache-dtype`).
"""

from __future__ import annotations

import argparse
from typing import Any

from harness import CACHE_ROOT, print_report
from quality import perplexity, text_chunks
from throughput import AGREEMENT_PREFIX, answers_agreement, chat_prompts

KV_DTYPES = ("auto", "int8", "fp8")
GATES = {"int8": 0.005, "fp8": 0.01}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2-135m-instruct", help="comma-separated")
    p.add_argument("--chunks", type=int, default=None, help="text chunks scored; default all")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=AGREEMENT_PREFIX)
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    p.add_argument("--context", type=int, default=2048, help="tokens per sequence, capacity")
    p.add_argument("--quantization", choices=["none", "gguf"], default="none")
    return p.parse_args()


def model_figures(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from pagedbatch.engine import LLM, SamplingParams
    from pagedbatch.pypi_models import GEMMA_TURNS, fetch

    path = fetch(name, CACHE_ROOT / "models")
    template = GEMMA_TURNS if name.startswith("gemma") else None
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    figures: dict[str, Any] = {}
    answers: dict[str, list[list[int]]] = {}
    for kv in KV_DTYPES:
        llm = LLM(
            path,
            quantization=args.quantization,
            kv_cache_dtype=kv,
            chat_template=template,
            num_kv_blocks=2048,
            max_num_seqs=args.prompts,
        )
        runner = llm.engine.runner
        chunks = text_chunks(llm.tokenizer)[: args.chunks]
        prompts = chat_prompts(llm.tokenizer, args.prompts)
        answers[kv] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        blocks = int(args.kv_cache_memory_gib * 2**30 // runner.kv_bytes_per_block)
        figures[kv] = {
            "stored_as": runner.kv_cache_dtype_name,
            "perplexity": round(perplexity(llm, chunks), 4),
            "tokens_scored": sum(len(c) - len(c) // 2 - 1 for c in chunks),
            "kv_bytes_per_token": runner.kv_bytes_per_block // runner.block_size,
            "blocks": blocks,
            "max_sequences": blocks // -(-args.context // runner.block_size),
        }
        llm.shutdown()
    auto = figures["auto"]
    for kv in KV_DTYPES[1:]:
        ratio = figures[kv]["perplexity"] / auto["perplexity"]
        figures[kv]["perplexity_vs_auto"] = round(ratio - 1, 5)
        figures[kv]["within_gate"] = abs(ratio - 1) <= GATES[kv]
        figures[kv]["capacity_vs_auto"] = round(figures[kv]["blocks"] / auto["blocks"], 3)
        figures[kv]["agreement_with_auto"] = answers_agreement(answers["auto"], answers[kv])
    return figures


def main() -> None:
    args = parse_args()
    report: dict[str, Any] = {
        "quantization": args.quantization,
        "kv_cache_memory_gib": args.kv_cache_memory_gib,
        "context": args.context,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "models": {},
    }
    for name in args.models.split(","):
        report["models"][name] = model_figures(name, args)
    print_report(report)


if __name__ == "__main__":
    main()

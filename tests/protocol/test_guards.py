"""Reading a moderation model: a Llama-Guard-shaped guard's score is the probability of "unsafe"
as its first token, equal to transformers' softmax there within 1e-4, read while the grammar
makes it write the codes, whose categories get that score; a text past the context is read in
windows, its score the highest of theirs."""

from __future__ import annotations

import pytest
import torch
from moderation_oracle import classifier_scores
from transformers import AutoModelForCausalLM

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.moderation import GUARD_CODES
from pagedbatch.protocol.serving.guards import (
    UNSAFE,
    Classifier,
    GenerativeGuard,
    guard_of,
    highest,
)

TEXTS = ["You are wonderful.", "I will find you.", "Recipes for a quiet evening.", "Hello"]


@pytest.fixture(scope="module")
def guard_path(make_checkpoint):
    return make_checkpoint("llama", task="guard")


def test_the_guards_unsafe_probability_is_transformers(guard_path):
    llm = LLM(str(guard_path), max_num_batched_tokens=256, num_kv_blocks=512)
    guard = guard_of(llm.engine)
    assert isinstance(guard, GenerativeGuard)
    prompts = [guard.prompts(text)[0] for text in TEXTS]
    # Batched with other work: a plain generation in the same steps.
    other = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([*prompts, prompts[0]], [guard.params] * len(prompts) + [other])
    reference = AutoModelForCausalLM.from_pretrained(guard_path, dtype=torch.float32)
    unsafe = llm.tokenizer.encode(UNSAFE, add_special_tokens=False)[0]
    for prompt, output in zip(prompts, outputs, strict=False):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt])).logits[0, -1]
        expected = logits.softmax(-1)[unsafe].item()
        choice = output.outputs[0]
        assert choice.text.startswith(f"{UNSAFE}\n")
        codes = choice.text.partition("\n")[2].split(",")
        assert codes and set(codes) <= set(GUARD_CODES)
        scores = guard.scores(choice)
        assert max(scores.values()) == pytest.approx(expected, abs=1e-4)
        flagged = {GUARD_CODES[code][1] for code in codes} - {None}
        assert {c for c, s in scores.items() if s > 0} == flagged
    assert outputs[-1].outputs[0].scores is None  # the other work asked for none


def test_a_text_past_the_context_is_read_in_windows(make_checkpoint):
    path = make_checkpoint("llama", task="classify")
    llm = LLM(str(path), max_model_len=64, num_kv_blocks=64)
    classifier = guard_of(llm.engine)
    assert isinstance(classifier, Classifier)
    text = " ".join(f"word{i}" for i in range(200))
    windows = classifier.prompts(text)
    assert len(windows) > 2 and all(len(w) <= 63 for w in windows)
    assert sum(windows, []) == llm.tokenizer.encode(text)
    outputs = llm.generate(windows, classifier.params)
    read = highest([classifier.scores(o.outputs[0]) for o in outputs])
    assert read == pytest.approx(highest(classifier_scores(path, windows)), abs=1e-4)

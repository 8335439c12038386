"""Sequence classifiers (`*ForSequenceClassification`) run by the engine: a request asking for
scores gets the score head's logits at its last prompt token, equal to transformers' within
1e-4 after the sigmoid, for prompts of any length batched together and prefilled in chunks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.config import ModelConfig
from pagedbatch.moderation import CATEGORIES

SCORES = SamplingParams(max_tokens=1, temperature=0.0, scores=True)


def prompts() -> list[list[int]]:
    """Prompts from 3 to 300 tokens (longer than a 64-token chunk), none holding the pad token
    transformers looks for to find the last token."""
    return [[(i * 37 + n * 11) % 4000 + 300 for i in range(n)] for n in (3, 17, 64, 150, 300)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_scores_equal_transformers(make_checkpoint, arch):
    path = make_checkpoint(arch, task="classify")
    assert ModelConfig.load(path).labels == list(CATEGORIES)
    reference = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    llm = LLM(str(path), max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64)
    outputs = llm.generate(prompts(), SCORES)
    for prompt, output in zip(prompts(), outputs, strict=True):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        scores = output.outputs[0].scores
        assert scores.shape == (len(CATEGORIES),)
        torch.testing.assert_close(scores.sigmoid(), expected.sigmoid(), atol=1e-4, rtol=0)
    # The head moves with the input: not one score vector for all.
    spread = torch.stack([o.outputs[0].scores for o in outputs]).sigmoid().std(dim=0)
    assert spread.min() > 0.01


def test_a_language_models_scores_are_its_first_tokens_logits(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    params = SamplingParams(max_tokens=3, temperature=0.0, scores=True, logprobs=0)
    output = llm.generate([[300, 301, 302]], params)[0].outputs[0]
    first = output.logprobs[0]
    assert output.scores.shape == (ModelConfig.load(tiny_llama).vocab_size,)
    assert int(output.scores.argmax()) == output.token_ids[0]
    assert output.scores.log_softmax(-1)[output.token_ids[0]].item() == pytest.approx(
        first.logprob, abs=1e-5
    )
    plain = llm.generate([[300, 301, 302]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert plain.outputs[0].scores is None

"""What transformers makes of a moderation classifier: each input's category scores, the sigmoid
of its label logits at the last token, to check ours against."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from pagedbatch.moderation import CATEGORIES


def classifier_scores(path: Path, inputs: list[str] | list[list[int]]) -> list[dict[str, float]]:
    """Per input (a text, or token ids), transformers' score of each category."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    scores = []
    for given in inputs:
        ids = tokenizer(given, return_tensors="pt").input_ids if isinstance(given, str) else None
        with torch.no_grad():
            logits = model(ids if ids is not None else torch.tensor([given])).logits[0]
        scores.append(dict(zip(CATEGORIES, logits.sigmoid().tolist(), strict=True)))
    return scores

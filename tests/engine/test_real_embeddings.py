"""The trained all-MiniLM-L6-v2 (from PyPI) served as it is: every vector equals
sentence-transformers' `encode(normalize_embeddings=True)` of the same text, whether the
sentences run all together or one at a time."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer

from pagedbatch.engine import LLM

pytestmark = pytest.mark.real_model

NAME = "all-minilm-l6-v2"
TOPICS = (
    "the weather in spring", "a recipe for bread", "the history of Rome", "how engines work",
    "a football match", "quantum computing", "learning to paint", "the stock market today",
    "a trip to the mountains", "cats and dogs", "the ocean at night", "a new phone",
)  # fmt: skip
# Words that each make a token or two.
FILLER = "and then we talked about it for a while although nobody could agree on what it meant"
FILLER = FILLER.split()


def sentences(count: int) -> list[str]:
    """Mixed lengths, from a few words to past a hundred, and a few odd ones."""
    rng = random.Random(0)
    out = [
        f"Sentence {i} is about {rng.choice(TOPICS)}: " + " ".join(rng.choices(FILLER, k=k))
        for i, k in enumerate(rng.choices([1, 3, 8, 15, 30, 60, 120], k=count - 4))
    ]
    return out + ["Hi", "naïve café — 東京 🌊", "A" * 300, "why?"]


@pytest.fixture(scope="module")
def minilm(real_model) -> Path:
    return real_model(NAME)


@pytest.mark.parametrize("precision", ["highest", "bfloat16"])
def test_minilm_equals_sentence_transformers_batched_and_one_by_one(minilm, precision):
    """In float32 arithmetic, and with the bfloat16 matmuls that CPUs with AMX take."""
    texts = sentences(256)
    want = SentenceTransformer(str(minilm), device="cpu").encode(
        texts, normalize_embeddings=True, convert_to_tensor=True
    )
    llm = LLM(minilm, matmul_precision=precision)
    assert llm.engine.max_model_len == 256 and llm.engine.pooling.dimensions == 384
    together = torch.stack([o.embedding for o in llm.embed(texts)])
    alone = torch.stack([llm.embed([text])[0].embedding for text in texts])
    for got in (together, alone):
        cosine = F.cosine_similarity(got, want, dim=-1)
        assert cosine.min() >= 0.9999, (cosine.min(), texts[int(cosine.argmin())])
    # Meaning shows: a sentence is nearer a paraphrase than an unrelated one.
    cat, kitten, market = (o.embedding for o in llm.embed(
        ["A cat sleeps on the sofa.", "A kitten is napping on the couch.", "Stocks fell today."]
    ))  # fmt: skip
    assert cat @ kitten > cat @ market + 0.3

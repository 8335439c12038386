import pytest
import torch

from pagedbatch.engine.sample import greedy
from pagedbatch.engine.sample.greedy import argmax, greedy_tokens

VOCAB = 1000


def head(weights: torch.Tensor):
    """compute_logits over a float head, counting the vocabulary columns each call makes."""
    widths: list[int] = []

    def logits_of(hidden: torch.Tensor, vocab: slice) -> torch.Tensor:
        part = weights[vocab]
        widths.append(part.shape[0])
        return hidden @ part.T

    return logits_of, widths


@pytest.fixture
def small_slices(monkeypatch):
    # 4 rows of float32 logits: 256 tokens a slice, so 1,000 tokens take 4 (the last 232).
    monkeypatch.setattr(greedy, "SLICE_BYTES", 4 * 4 * 256)


@pytest.mark.usefixtures("small_slices")
def test_the_tokens_are_the_whole_rows_argmax_made_a_slice_at_a_time():
    generator = torch.Generator().manual_seed(0)
    # Small integers: every sum exact, so slices and the whole agree to the bit.
    weights = torch.randint(-8, 8, (VOCAB, 16), generator=generator).float()
    hidden = torch.randint(-8, 8, (4, 16), generator=generator).float()
    logits_of, widths = head(weights)
    tokens = greedy_tokens(hidden, logits_of, VOCAB)
    assert widths == [256, 256, 256, 232]
    assert torch.equal(tokens, (hidden @ weights.T).argmax(dim=-1))


@pytest.mark.usefixtures("small_slices")
def test_ties_go_to_the_lowest_id_across_slices_and_a_nan_wins():
    logits = torch.zeros(4, VOCAB)
    logits[0, [3, 700]] = 5.0  # a tie between slices 0 and 2
    logits[1, [300, 900]] = 2.0  # a tie between slices 1 and 3
    logits[2, [10, 600]] = torch.tensor([9.0, float("nan")])  # as numpy's argmax takes it
    logits[3, [5, 999]] = -1.0  # zeros everywhere else: id 0
    rows = torch.empty(4, 8)  # the logits below stand for these rows'

    def logits_of(hidden: torch.Tensor, vocab: slice) -> torch.Tensor:
        return logits[:, vocab]

    assert greedy_tokens(rows, logits_of, VOCAB).tolist() == [3, 300, 600, 0]
    assert argmax(logits).tolist() == [3, 300, 600, 0]


@pytest.mark.usefixtures("small_slices")
def test_a_head_that_cannot_slice_the_vocabulary_is_taken_whole():
    weights = torch.randn(VOCAB, 4, generator=torch.Generator().manual_seed(1))
    logits_of, widths = head(weights)
    hidden = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    tokens = greedy_tokens(hidden, logits_of, None)
    assert widths == [VOCAB] and torch.equal(tokens, argmax(hidden @ weights.T))


def test_few_rows_take_the_vocabulary_in_one_piece():
    weights = torch.randn(VOCAB, 4, generator=torch.Generator().manual_seed(3))
    logits_of, widths = head(weights)
    greedy_tokens(torch.randn(2, 4), logits_of, VOCAB)
    assert widths == [VOCAB]

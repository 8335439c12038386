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


class Screen:
    """An approximate head as adversarial as its bound allows: each approximate logit off by
    up to its bound (random sign and size), the bound `spread` a logit (or a row's own); the
    hidden rows are their indices (`rows`); exact logits of the ids and rows asked counted."""

    def __init__(self, logits: torch.Tensor, spread: float | torch.Tensor, seed: int = 0):
        self.logits = logits
        self.spread = torch.as_tensor(spread, dtype=torch.float32).expand(logits.shape[0])
        self.generator = torch.Generator().manual_seed(seed)
        self.exact_ids: list[int] = []
        self.exact_shapes: list[tuple[int, int]] = []

    def approximates(self, x: torch.Tensor) -> bool:
        return True

    def approximate(self, x: torch.Tensor, part: slice, out: torch.Tensor) -> torch.Tensor:
        exact = self.logits[:, part]
        noise = torch.rand(exact.shape, generator=self.generator) * 2 - 1
        return torch.add(exact, noise * self.spread[:, None], out=out)

    def error_bound(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.spread.clone(), torch.ones(self.logits.shape[1])

    def rows_product(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.exact_ids += ids.tolist()
        self.exact_shapes.append((x.shape[0], len(ids)))
        return self.logits[x[:, 0].long()][:, ids]


def rows(count: int) -> torch.Tensor:
    """Hidden rows that name themselves: row i holds i (see `Screen`)."""
    return torch.arange(count, dtype=torch.float32)[:, None].expand(count, 8).contiguous()


def unused_head(hidden: torch.Tensor, vocab: slice) -> torch.Tensor:
    raise AssertionError("a screened step takes no exact slice")


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("spread", [1e-3, 0.5, 3.0])
def test_a_screened_step_takes_the_exact_argmax_from_its_candidates_alone(spread):
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(16, VOCAB, generator=generator) * 4
    logits[:, 500] = logits[:, 10] = logits.amax(1) + 0.5 * spread  # ties, nearer than the bound
    screen = Screen(logits, spread)
    tokens = greedy_tokens(rows(16), unused_head, VOCAB, screen)
    assert tokens.tolist() == [10] * 16  # the lowest id of the tie
    if spread <= 0.5:  # logits within 4 bounds of the best are few: candidates, not the vocabulary
        assert len(set(screen.exact_ids)) < VOCAB / 10


@pytest.mark.usefixtures("small_slices")
def test_a_screened_step_matches_the_whole_rows_argmax_on_random_logits():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(32, VOCAB, generator=generator)
    tokens = greedy_tokens(rows(32), unused_head, VOCAB, Screen(logits, 0.2))
    assert torch.equal(tokens, argmax(logits))


@pytest.mark.usefixtures("small_slices")
def test_a_row_whose_candidates_are_the_vocabulary_takes_them_a_part_at_a_time(monkeypatch):
    """The candidates' exact logits come a part at a time, each for the rows with candidates in
    it: one row's bound spanning the vocabulary makes no other row's exact logits of every token,
    and a part's weight rows and logits stay within CANDIDATE_PART_BYTES however many there are."""
    # 128 candidates a part: their float32 weight rows of 8 inputs, two logits for each of 16 rows
    monkeypatch.setattr(greedy, "CANDIDATE_PART_BYTES", 128 * 4 * (8 + 2 * 16))
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(8))
    spread = torch.full((16,), 1e-3)
    spread[3] = 100.0  # far wider than the logits' range: every token its candidate
    screen = Screen(logits, spread)
    tokens = greedy_tokens(rows(16), unused_head, VOCAB, screen)
    assert torch.equal(tokens, argmax(logits))
    widths = [width for _, width in screen.exact_shapes]  # row 3's candidates: most tokens
    assert sum(widths) == len(set(screen.exact_ids)) > 3 * 256
    assert widths[:-1] == [128] * (len(widths) - 1) and 0 < widths[-1] <= 128
    assert sum(height for height, _ in screen.exact_shapes) < len(widths) + 2 * 15


@pytest.mark.usefixtures("small_slices")
def test_a_token_whose_approximation_is_nan_is_a_candidate_and_a_nan_logit_wins():
    logits = torch.zeros(12, VOCAB)
    logits[:, 20] = 1.0
    logits[3, 900] = float("nan")  # a weight row that is NaN
    tokens = greedy_tokens(rows(12), unused_head, VOCAB, Screen(logits, 0.1))
    assert tokens.tolist() == [20, 20, 20, 900] + [20] * 8


def test_hidden_states_that_are_not_finite_take_the_exact_slices():
    weights = torch.randn(VOCAB, 4, generator=torch.Generator().manual_seed(6))
    logits_of, widths = head(weights)
    hidden = torch.randn(12, 4, generator=torch.Generator().manual_seed(7))
    hidden[2, 1] = float("inf")
    screen = Screen(hidden @ weights.T, 0.1)
    tokens = greedy_tokens(hidden, logits_of, VOCAB, screen)
    assert widths and not screen.exact_ids
    assert torch.equal(tokens, argmax(hidden @ weights.T))

import itertools
import math

import pytest
import torch

from pagedbatch.engine.core.request import Request
from pagedbatch.engine.sample.sampler import Sampler, _top_k_top_p_rows
from pagedbatch.engine.sampling_params import SamplingParams

# Four tokens with probabilities 0.5, 0.3, 0.15 and 0.05 (and a fifth that is impossible).
PROBS = [0.5, 0.3, 0.15, 0.05, 0.0]
LOGITS = [math.log(p) if p else float("-inf") for p in PROBS]
# The requests of one sampler call have distinct ids, as the engine's do.
_ids = itertools.count()


@pytest.fixture(autouse=True)
def _seeded_torch() -> None:
    # Unseeded rows draw from torch's default generator: fixing it keeps the statistics stable.
    torch.manual_seed(0)


def request(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
    **params,
) -> Request:
    params = SamplingParams(max_tokens=100, **params)
    req = Request(f"r{next(_ids)}", prompt or [0], params, eos_token_ids=eos)
    for token in output or []:
        req.append_output_token(token)
    return req


def tokens(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    return [token for token, _ in Sampler()(logits.clone(), requests)]


def draws(row: list[float], n: int = 4000, **params) -> torch.Tensor:
    """How often each token is drawn from `row` by n requests with the same params."""
    logits = torch.tensor([row] * n)
    sampled = torch.tensor(tokens(logits, [request(**params) for _ in range(n)]))
    return torch.bincount(sampled, minlength=len(row)) / n


def test_greedy_takes_the_argmax_and_the_first_of_ties():
    logits = torch.randn(16, 1000)
    logits[3, [20, 10]] = 100.0
    greedy = tokens(logits, [request(temperature=0.0) for _ in range(16)])
    assert greedy == logits.argmax(-1).tolist()
    assert greedy[3] == 10


def test_a_temperature_near_zero_equals_greedy():
    logits = torch.stack([torch.randperm(500).float() for _ in range(8)])
    expected = logits.argmax(-1).tolist()
    assert tokens(logits, [request(temperature=1e-3) for _ in range(8)]) == expected


def test_top_k_1_equals_greedy():
    logits = torch.randn(32, 2000)
    assert tokens(logits, [request(top_k=1) for _ in range(32)]) == logits.argmax(-1).tolist()


def test_greedy_rows_next_to_sampled_rows_stay_greedy():
    logits = torch.randn(8, 300)
    reqs = [request(temperature=0.0 if i % 2 else 1.0, top_p=0.9) for i in range(8)]
    sampled = tokens(logits, reqs)
    assert sampled[1::2] == logits[1::2].argmax(-1).tolist()


def test_temperature_scales_the_logits():
    # p(token 1) = sigmoid((1 - 0) / T)
    frequency = draws([0.0, 1.0], n=20000, temperature=0.5)[1].item()
    assert frequency == pytest.approx(1 / (1 + math.exp(-2.0)), abs=0.015)


def test_unrestricted_sampling_follows_the_distribution():
    frequencies = draws(LOGITS, n=20000)
    assert frequencies.tolist() == pytest.approx(PROBS, abs=0.015)


def test_top_k_samples_only_the_k_likeliest():
    frequencies = draws(LOGITS, top_k=2)
    assert frequencies[2:].sum() == 0
    assert frequencies[0].item() == pytest.approx(0.5 / 0.8, abs=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 alone is short of 0.75, 0.5 + 0.3 reaches it.
    frequencies = draws(LOGITS, top_p=0.75)
    assert frequencies[2:].sum() == 0
    assert frequencies[0].item() == pytest.approx(0.5 / 0.8, abs=0.03)


def test_top_p_always_keeps_the_likeliest_token():
    assert draws(LOGITS, n=200, top_p=0.1)[0] == 1.0


def test_min_p_drops_tokens_below_a_fraction_of_the_likeliest():
    # The bar is 0.2 * 0.5 = 0.1: token 2 (0.15) stays, token 3 (0.05) goes.
    frequencies = draws(LOGITS, min_p=0.2)
    assert frequencies[3:].sum() == 0
    assert frequencies[2].item() == pytest.approx(0.15 / 0.95, abs=0.03)


def test_each_row_is_filtered_by_its_own_settings():
    n = 3000
    settings = [{"top_k": 1}, {"top_p": 0.75}, {"min_p": 0.2}, {"top_k": 3, "top_p": 0.9}, {}]
    reqs = [request(**settings[i % len(settings)]) for i in range(n)]
    sampled = torch.tensor(tokens(torch.tensor([LOGITS] * n), reqs))
    allowed = [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2}, {0, 1, 2, 3}]
    for i, kept in enumerate(allowed):
        assert set(sampled[i :: len(settings)].tolist()) == kept


def test_presence_penalty_lowers_each_generated_token_once():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    # 2.0 - 0.15 = 1.85 falls below 1.9; 2.0 - 0.05 does not, however often token 0 occurred.
    assert tokens(logits, [request(output=[0], temperature=0.0, presence_penalty=0.15)]) == [1]
    assert tokens(logits, [request(output=[0] * 5, temperature=0.0, presence_penalty=0.05)]) == [0]


def test_frequency_penalty_lowers_a_token_per_occurrence():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert tokens(logits, [request(output=[0], temperature=0.0, frequency_penalty=0.08)]) == [0]
    assert tokens(logits, [request(output=[0, 0], temperature=0.0, frequency_penalty=0.08)]) == [1]


def test_presence_and_frequency_penalties_ignore_the_prompt():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    req = request(prompt=[0, 0], temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert tokens(logits, [req]) == [0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    positive = torch.tensor([[2.0, 1.5, 0.0]])  # 2.0 / 1.4 = 1.43 < 1.5; 2.0 / 1.2 = 1.67 > 1.5
    assert tokens(positive, [request(prompt=[0], temperature=0.0, repetition_penalty=1.4)]) == [1]
    assert tokens(positive, [request(prompt=[0], temperature=0.0, repetition_penalty=1.2)]) == [0]
    negative = torch.tensor([[-1.0, -1.4, -9.0]])  # -1.0 * 1.5 = -1.5 < -1.4; * 1.3 = -1.3
    assert tokens(negative, [request(output=[0], temperature=0.0, repetition_penalty=1.5)]) == [1]
    assert tokens(negative, [request(output=[0], temperature=0.0, repetition_penalty=1.3)]) == [0]


def test_a_penalty_that_rounds_to_zero_never_samples_a_masked_token():
    """1e-86 is 0 in float32: a seen token masked to -inf would become NaN and a positive logit
    +inf; sampling must still keep to the tokens left."""
    logits = torch.tensor([[float("-inf"), 2.0, 1.0, float("-inf"), -1.0]])
    seen = [0, 1, 3, 4]
    for temperature in (0.0, 1.0):
        for _ in range(20):
            chosen = tokens(
                logits, [request(prompt=seen, temperature=temperature, repetition_penalty=1e-86)]
            )
            assert chosen[0] in (1, 2, 4)
    greedy = tokens(logits, [request(prompt=seen, temperature=0.0, repetition_penalty=1e-86)])
    assert greedy == [1]  # 2.0 / 0 is the largest finite value


def test_penalties_apply_to_sampled_rows_too():
    # Token 0 is pushed to 5.0 - 2.0 * 1 - 2.0 * 5 = -7: it should (almost) never be drawn.
    reqs = [
        request(output=[0] * 5, presence_penalty=2.0, frequency_penalty=2.0) for _ in range(500)
    ]
    assert 0 not in tokens(torch.tensor([[5.0, 0.0, 0.0]] * 500), reqs)


def test_min_tokens_holds_back_eos_and_stop_tokens():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    early = {"eos": frozenset({0}), "min_tokens": 2, "stop_token_ids": [1], "temperature": 0.0}
    assert tokens(logits, [request(output=[3], **early)]) == [2]
    assert tokens(logits, [request(output=[3, 3], **early)]) == [0]
    assert tokens(logits, [request(output=[3], ignore_eos=True, **early)]) == [0]


def test_logits_processors_see_the_output_and_shape_the_row():
    seen = []

    def only_seven(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        seen.append(list(output_ids))
        mask = torch.full_like(row, float("-inf"))
        mask[7] = 0.0
        return row + mask

    def in_place(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        row[:3] = float("-inf")
        return row

    logits = torch.zeros(3, 20)
    reqs = [
        request(output=[4, 5], logits_processors=[only_seven]),
        request(temperature=0.0, logits_processors=[only_seven]),
        request(temperature=0.0, logits_processors=[in_place]),
    ]
    assert tokens(logits, reqs) == [7, 7, 3]
    assert seen == [[4, 5], []]


def test_logits_made_under_inference_mode_are_accepted():
    with torch.inference_mode():
        logits = torch.randn(4, 100)
    reqs = [request(temperature=0.7, top_p=0.9, repetition_penalty=1.2, logprobs=2)] * 4
    assert len(Sampler()(logits, reqs)) == 4


def test_a_seed_reproduces_whatever_the_batch_around_it():
    row = torch.randn(1000)
    seeded = request(seed=1234, output=[1, 2, 3])
    alone = tokens(row[None], [seeded])
    for position, size in [(0, 4), (3, 8), (7, 8)]:
        logits = torch.randn(size, 1000)
        logits[position] = row
        others = [request(top_p=0.9, top_k=50, seed=i) for i in range(size)]
        others[position] = seeded
        assert tokens(logits, others)[position] == alone[0]


def test_a_seeded_draw_depends_on_the_output_position():
    # Recomputing after preemption keeps the output, so the position gives the same draws again.
    row = torch.zeros(1, 1000)
    by_position = [tokens(row, [request(seed=5, output=[9] * k)])[0] for k in range(20)]
    again = [tokens(row, [request(seed=5, output=[9] * k)])[0] for k in range(20)]
    other_seed = [tokens(row, [request(seed=6, output=[9] * k)])[0] for k in range(20)]
    assert by_position == again
    assert len(set(by_position)) > 10
    assert other_seed != by_position


def test_unseeded_rows_draw_independently():
    assert len(set(tokens(torch.zeros(64, 1000), [request() for _ in range(64)]))) > 32


def test_logprobs_are_the_raw_log_softmax_with_ranks_and_top_alternatives():
    logits = torch.randn(4, 500) * 3
    logits[2, [10, 11]] = torch.tensor([20.0, 15.0])  # the penalty drops token 10 to 10.0
    raw = torch.log_softmax(logits, dim=-1)
    reqs = [
        request(temperature=0.0, logprobs=5),
        request(logprobs=3, temperature=1.5, top_p=0.9, seed=1),
        request(temperature=0.0, logprobs=0, repetition_penalty=2.0, prompt=[10]),
        request(temperature=0.0),
    ]
    results = Sampler()(logits.clone(), reqs)
    for i, (token, logprob) in enumerate(results[:3]):
        assert logprob.token_id == token
        assert logprob.logprob == pytest.approx(raw[i, token].item(), abs=1e-4)
        assert logprob.rank == int((raw[i] > raw[i, token]).sum()) + 1
        width = reqs[i].sampling_params.logprobs
        top = raw[i].topk(width)
        assert [t for t, _ in logprob.top] == top.indices.tolist()
        assert [lp for _, lp in logprob.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert results[0][1].rank == 1
    assert results[2][0] == 11
    assert results[2][1].rank == 2 and results[2][1].top == []
    assert results[3][1] is None


def test_logit_bias_is_added_per_row_and_a_min_tokens_ban_beats_it():
    logits = torch.zeros(3, 6)
    reqs = [
        request(temperature=0.0, logit_bias={4: 2.0, 1: -1.0}),
        request(temperature=0.0),
        request(temperature=0.0, logit_bias={2: 100.0}, stop_token_ids=[2], min_tokens=1),
    ]
    biased = logits.clone()
    Sampler()(biased, reqs)
    assert biased[0].tolist() == [0.0, -1.0, 0.0, 0.0, 2.0, 0.0]
    assert biased[1].tolist() == [0.0] * 6
    assert biased[2, 2] == float("-inf")
    assert tokens(logits, reqs) == [4, 0, 0]


def test_a_top_k_beyond_the_vocabulary_keeps_every_token():
    for top_p in (1.0, 0.99):
        drawn = draws(LOGITS, top_k=2**63, top_p=top_p)
        assert drawn[3] > 0.0  # the least likely possible token is still drawn


def test_penalties_follow_the_output_as_it_grows_from_call_to_call():
    sampler = Sampler()
    logits = torch.tensor([[2.0, 1.9, 1.8, 0.0]])
    req = request(prompt=[3], temperature=0.0, frequency_penalty=0.25)
    chosen = []
    for _ in range(4):
        token, _ = sampler(logits.clone(), [req])[0]
        chosen.append(token)
        req.append_output_token(token)
    # Each pick is penalised 0.25 per occurrence: 0 (2.0), 1 (1.9), 2 (1.8), then 0 (1.75).
    assert chosen == [0, 1, 2, 0]


def test_a_request_id_used_again_starts_from_its_own_tokens():
    sampler = Sampler()
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    first = Request("same", [0], SamplingParams(temperature=0.0, repetition_penalty=2.0))
    assert sampler(logits.clone(), [first])[0][0] == 1  # token 0, in the prompt, 2.0 -> 1.0
    sampler.release("same")
    again = Request("same", [2], SamplingParams(temperature=0.0, repetition_penalty=2.0))
    assert sampler(logits.clone(), [again])[0][0] == 0
    # Not released: a new request under the id still counts only its own tokens.
    third = Request("same", [2], SamplingParams(temperature=0.0, repetition_penalty=2.0))
    assert sampler(logits.clone(), [third])[0][0] == 0


def test_top_p_and_top_k_break_ties_by_token_id():
    # Four equally likely tokens: half the mass is tokens 0 and 1, the first two by id.
    assert set(draws([0.0] * 4, n=400, top_p=0.5).nonzero()[:, 0].tolist()) == {0, 1}
    assert set(draws([0.0] * 4, n=400, top_k=3, top_p=0.99).nonzero()[:, 0].tolist()) == {0, 1, 2}
    # Tied with the last token kept, beyond the nucleus: dropped all the same.
    row = [1.0, 0.0, 0.0, 0.0, -1.0]
    p1 = math.exp(1) / (math.exp(1) + 3 + math.exp(-1))  # 0.5 or so: token 0 alone is short
    assert set(draws(row, n=400, top_p=p1 + 0.01).nonzero()[:, 0].tolist()) == {0, 1}


def test_a_top_p_below_float32s_least_value_keeps_the_likeliest_token():
    """OpenAI allows any top_p above 0; 5e-324 rounds to 0 in float32, which the first token's
    share of nothing "reaches": the likeliest token must still be kept, not index -1."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    params = [SamplingParams(top_p=5e-324, min_p=1.0, temperature=1.0, seed=1)]
    _top_k_top_p_rows(logits, params, [0])
    assert logits[0].argmax().item() == 1
    assert torch.isinf(logits[0, [0, 2, 3]]).all()

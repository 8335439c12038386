"""Turns one engine step's next-token logits into tokens, one request per row."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagedbatch.engine.core.request import Request, TokenLogprob
from pagedbatch.engine.sample.greedy import argmax
from pagedbatch.engine.sample.token_counts import TokenCounts
from pagedbatch.engine.sampling_params import SamplingParams

SampleResult = tuple[int, TokenLogprob | None]
# Masks, in place, the logits each request's structured output forbids (rows as `requests`).
TokenMasker = Callable[[torch.Tensor, Sequence[Request]], None]

_MASK64 = (1 << 64) - 1
# Rows that top-k/top-p filtering takes at once on CPU (measured on a 16k vocabulary: 32 to 64
# rows ran twice as fast as 256 at once).
CPU_ROWS_PER_PASS = 32


class Sampler:
    """Samples every row of a step's logits under its request's SamplingParams.

    Order: raw logprobs are read first; then logits processors, logit_bias, the min_tokens ban
    on stop tokens and the penalties adjust the logits; greedy rows take the argmax of the result;
    the other rows go through temperature, top-k, top-p and min-p and draw with the exponential
    race, `argmax(probs / Exponential(1))`, which needs no normalisation and lets each row use its
    own random numbers. A seeded request's numbers come from (seed, output position) alone, so its
    tokens depend neither on the batch around it nor on being preempted and recomputed; unseeded
    rows share torch's default generator.

    Structured-output masks (`token_masker`) go on the logits right after the raw logprobs are
    read. The logits are modified in place. The penalties read token counts kept from call to
    call (`TokenCounts`): the requests of one call have distinct ids, and `release` drops a
    finished request's counts.
    """

    def __init__(self, token_masker: TokenMasker | None = None):
        self.token_masker = token_masker
        self.token_counts = TokenCounts()

    def release(self, request_id: str) -> None:
        """Forget what is kept about a request that will not be sampled again."""
        self.token_counts.release(request_id)

    # Logits made under inference mode may only be changed in place under it too.
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampleResult]:
        if all(_plain_greedy(request) for request in requests):
            return [(token, None) for token in argmax(logits).tolist()]
        logprob_rows = [
            i for i, request in enumerate(requests) if request.sampling_params.logprobs is not None
        ]
        raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
        if self.token_masker is not None:
            self.token_masker(logits, requests)
        _apply_row_processors(logits, requests)
        _apply_bias_and_bans(logits, requests)
        _apply_penalties(logits, requests, self.token_counts)
        tokens = _choose(logits, requests)
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            widths = [requests[i].sampling_params.logprobs or 0 for i in logprob_rows]
            found = _logprobs(raw_logprobs, tokens[logprob_rows], widths)
            for i, logprob in zip(logprob_rows, found, strict=True):
                logprobs[i] = logprob
        return list(zip(tokens.tolist(), logprobs, strict=True))


def edits_logits(requests: Sequence[Request]) -> bool:
    """Whether sampling these requests changes the logits it is given (in place)."""
    return not all(_plain_greedy(request) for request in requests)


def _plain_greedy(request: Request) -> bool:
    params = request.sampling_params
    return params.greedy and params.logprobs is None and not _adjusts_logits(request)


def _adjusts_logits(request: Request) -> bool:
    params = request.sampling_params
    return (
        bool(params.logits_processors)
        or bool(params.logit_bias)
        or params.structured is not None
        or _has_penalties(params)
        or bool(_banned_ids(request))
    )


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def _banned_ids(request: Request) -> list[int]:
    """The tokens that would stop the request while it is short of min_tokens."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    eos = [] if params.ignore_eos else list(request.eos_token_ids)
    return eos + params.stop_token_ids


def _apply_row_processors(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    for i, request in enumerate(requests):
        for processor in request.sampling_params.logits_processors:
            logits[i] = processor(request.output_token_ids, logits[i])


def _apply_bias_and_bans(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Add each row's logit_bias, then ban the stop tokens of rows short of min_tokens: one
    scatter each for the whole batch. A ban wins over any bias (-inf plus a bias stays -inf)."""
    bias_rows, bias_ids, biases, ban_rows, ban_ids = [], [], [], [], []
    for i, request in enumerate(requests):
        bias = request.sampling_params.logit_bias or {}
        bias_rows += [i] * len(bias)
        bias_ids += bias.keys()
        biases += bias.values()
        banned = _banned_ids(request)
        ban_rows += [i] * len(banned)
        ban_ids += banned
    device = logits.device
    if bias_rows:
        values = torch.tensor(biases, dtype=logits.dtype, device=device)
        logits.index_put_(_index(bias_rows, bias_ids, device), values, accumulate=True)
    if ban_rows:
        ban = torch.tensor(float("-inf"), dtype=logits.dtype, device=device)
        logits.index_put_(_index(ban_rows, ban_ids, device), ban)


def _index(rows: list[int], ids: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(ids, dtype=torch.long, device=device),
    )


def _apply_penalties(
    logits: torch.Tensor, requests: Sequence[Request], token_counts: TokenCounts
) -> None:
    """Penalise, in place, only the tokens each row's counts hold: a few per row of context,
    where the vocabulary-wide arithmetic would touch every logit of every row."""
    rows = [i for i, request in enumerate(requests) if _has_penalties(request.sampling_params)]
    if not rows:
        return
    params = [requests[i].sampling_params for i in rows]
    device, vocab = logits.device, logits.shape[-1]
    counted = token_counts.rows([requests[i] for i in rows], vocab, device)
    logit_row = torch.tensor(rows, device=device)
    if any(p.repetition_penalty != 1.0 for p in params):
        # HF/CTRL: every token of prompt and output seen so far, made less likely either way.
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
        row, token = token_counts.seen[counted].nonzero(as_tuple=True)
        values, factor = logits[logit_row[row], token], penalty[row]
        penalized = torch.where(values > 0, values / factor, values * factor)
        # A penalty that float32 rounds to 0 (1e-86, say) makes a masked token's -inf NaN and a
        # positive logit +inf, which would sample a token the mask forbids: keep both bounded.
        finite = torch.finfo(logits.dtype).max
        logits[logit_row[row], token] = penalized.nan_to_num_(float("-inf"), finite)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        # OpenAI: over the output only, once per distinct token plus once per occurrence.
        presence = torch.tensor([p.presence_penalty for p in params], device=device)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
        counts = token_counts.output[counted]
        row, token = counts.nonzero(as_tuple=True)
        logits[logit_row[row], token] -= frequency[row] * counts[row, token] + presence[row]


def _choose(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    rows = [i for i, request in enumerate(requests) if not request.sampling_params.greedy]
    if len(rows) == len(requests):
        return _sample(logits, requests)
    tokens = argmax(logits)
    if rows:
        tokens[rows] = _sample(logits[rows], [requests[i] for i in rows])
    return tokens


def _sample(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Draw one token per row of `logits`, changing them, for non-greedy requests."""
    params = [request.sampling_params for request in requests]
    device = logits.device
    logits /= torch.tensor([p.temperature for p in params], device=device)[:, None]
    vocab = logits.shape[-1]
    top_ks = [p.top_k if p.top_k < vocab else 0 for p in params]  # 0: keep every token
    if any(p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params, top_ks)
    elif any(top_ks):
        _top_k(logits, top_ks)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    uniform = torch.rand_like(probs)
    generator = None  # one for all seeded rows, reseeded for each
    for i, request in enumerate(requests):
        seed = request.sampling_params.seed
        if seed is not None:
            generator = generator or torch.Generator(device=device)
            generator.manual_seed(_draw_seed(seed, request.num_output_tokens))
            uniform[i].uniform_(generator=generator)
    # -log(U) is Exponential(1); on CPU it costs a quarter of exponential_().
    return argmax(probs.div_(uniform.log_().neg_()))


def _top_k(logits: torch.Tensor, ks: list[int]) -> None:
    """Mask all but each row's top k logits (ties with the k-th are kept); rows with 0 keep all."""
    widest = max(ks)
    index = torch.tensor([k - 1 if k else widest - 1 for k in ks], device=logits.device)
    kth = logits.topk(widest, dim=-1).values.gather(1, index[:, None])
    kth[torch.tensor([k == 0 for k in ks], device=logits.device)] = float("-inf")
    logits.masked_fill_(logits < kth, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams], ks: list[int]) -> torch.Tensor:
    """Mask, in place, what each row's top-k and top-p leave out; returns the logits. On CPU a
    few rows at a time: their vocabulary-wide temporaries then stay in cache, which halves the
    time for a large batch."""
    step = CPU_ROWS_PER_PASS if logits.device.type == "cpu" else len(params)
    for i in range(0, len(params), step):
        _top_k_top_p_rows(logits[i : i + step], params[i : i + step], ks[i : i + step])
    return logits


def _top_k_top_p_rows(logits: torch.Tensor, params: list[SamplingParams], ks: list[int]) -> None:
    """Mask, in place, what each row's top-k and top-p leave out.

    In (descending logit, token id) order, a token stays while its rank is below k and the
    likelier ones hold less than top_p: a prefix of that order, ties broken by token id so that
    a row's result does not depend on its batch. The sorted values alone say where the prefix
    ends (its length and last value): the tokens above that value stay and, of those equal to
    it, as many as the prefix holds, first by id.
    """
    device, vocab = logits.device, logits.shape[-1]
    values = _sorted_descending(logits)
    ranked = values
    if any(ks):
        k = torch.tensor([k or vocab for k in ks], device=device)[:, None]
        ranked = values.masked_fill(torch.arange(vocab, device=device) >= k, float("-inf"))
    probs = ranked.softmax(dim=-1)
    # Drop a token once the likelier ones reach top_p; the likeliest always stays. A top_p of 1
    # becomes infinite so that rounding in the cumulative sum never drops the tail.
    top_p = torch.tensor(
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device
    )
    # Along a row, what the likelier tokens hold only grows: they reach top_p from some point on.
    reached = probs.cumsum(dim=-1) - probs >= top_p[:, None]
    # At least one: a top_p below float32's least value (5e-324) rounds to 0, which the first
    # token's 0 "reaches".
    length = (vocab - reached.sum(dim=-1, keepdim=True)).clamp(min=1)
    if any(ks):
        length = torch.minimum(length, k)
    last = values.gather(1, length - 1)
    logits.masked_fill_(logits < last, float("-inf"))
    # Rows whose prefix ends inside a run of equal values: keep only its first tokens by id.
    beyond = values.gather(1, length.clamp(max=vocab - 1))
    cut = ((length < vocab) & (beyond == last) & (last > float("-inf")))[:, 0].nonzero()[:, 0]
    if cut.numel():
        rows, last = logits[cut], last[cut]
        ties = rows == last
        room = length[cut] - (rows > last).sum(dim=-1, keepdim=True)
        logits[cut] = rows.masked_fill_(ties & (ties.cumsum(dim=-1) > room), float("-inf"))


def _sorted_descending(logits: torch.Tensor) -> torch.Tensor:
    """Each row's values, largest first (no indices). numpy's sort is several times faster than
    torch's on CPU."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.sort(logits.numpy(), axis=-1)).flip(-1)
    return logits.sort(dim=-1, descending=True).values


def _draw_seed(seed: int, position: int) -> int:
    """The generator seed for a seeded request's token at `position` (splitmix64 mixing)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _logprobs(raw: torch.Tensor, chosen: torch.Tensor, widths: list[int]) -> list[TokenLogprob]:
    """Each row's chosen token under the raw distribution, its rank and its `width` likeliest."""
    chosen_logprob = raw.gather(1, chosen[:, None])
    ranks = ((raw > chosen_logprob).sum(dim=-1) + 1).tolist()
    top_values, top_ids = raw.topk(max(widths), dim=-1)
    return [
        TokenLogprob(token, logprob, rank, list(zip(ids[:width], values[:width], strict=True)))
        for token, logprob, rank, ids, values, width in zip(
            chosen.tolist(),
            chosen_logprob[:, 0].tolist(),
            ranks,
            top_ids.tolist(),
            top_values.tolist(),
            widths,
            strict=True,
        )
    ]

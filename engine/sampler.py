"""Turns one engine step's next-token logits into tokens, one request per row."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagedbatch.engine.request import Request, TokenLogprob
from pagedbatch.engine.sampling_params import SamplingParams

SampleResult = tuple[int, TokenLogprob | None]
# Masks, in place, the logits each request's structured output forbids (rows as `requests`).
TokenMasker = Callable[[torch.Tensor, Sequence[Request]], None]

_MASK64 = (1 << 64) - 1


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
    read. The logits are modified in place.
    """

    def __init__(self, token_masker: TokenMasker | None = None):
        self.token_masker = token_masker

    # Logits made under inference mode may only be changed in place under it too.
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampleResult]:
        if all(_plain_greedy(request) for request in requests):
            return [(token, None) for token in logits.argmax(dim=-1).tolist()]
        logprob_rows = [
            i for i, request in enumerate(requests) if request.sampling_params.logprobs is not None
        ]
        raw_logprobs = torch.log_softmax(logits[logprob_rows], dim=-1) if logprob_rows else None
        if self.token_masker is not None:
            self.token_masker(logits, requests)
        _apply_row_processors(logits, requests)
        _apply_bias_and_bans(logits, requests)
        _apply_penalties(logits, requests)
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


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    rows = [i for i, request in enumerate(requests) if _has_penalties(request.sampling_params)]
    if not rows:
        return
    params = [requests[i].sampling_params for i in rows]
    device, vocab = logits.device, logits.shape[-1]
    penalised = logits[rows]
    if any(p.repetition_penalty != 1.0 for p in params):
        # HF/CTRL: every token of prompt and output seen so far, made less likely either way.
        seen = _token_counts([requests[i].all_token_ids for i in rows], vocab, device) > 0
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        scaled = torch.where(penalised > 0, penalised / penalty, penalised * penalty)
        penalised = torch.where(seen, scaled, penalised)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        # OpenAI: over the output only, once per distinct token plus once per occurrence.
        counts = _token_counts([requests[i].output_token_ids for i in rows], vocab, device)
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        penalised -= frequency * counts + presence * (counts > 0)
    logits[rows] = penalised


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """counts[i, t]: how many times token t occurs in token_lists[i], as float32."""
    width = max(map(len, token_lists))
    # Padding points at an extra column that is cut off afterwards.
    padded = torch.tensor(
        [ids + [vocab] * (width - len(ids)) for ids in token_lists], dtype=torch.long
    ).to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _choose(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    rows = [i for i, request in enumerate(requests) if not request.sampling_params.greedy]
    if len(rows) == len(requests):
        return _sample(logits, requests)
    tokens = logits.argmax(dim=-1)
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
    for i, request in enumerate(requests):
        seed = request.sampling_params.seed
        if seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(_draw_seed(seed, request.num_output_tokens))
            uniform[i].uniform_(generator=generator)
    # -log(U) is Exponential(1); on CPU it costs a quarter of exponential_().
    return probs.div_(uniform.log_().neg_()).argmax(dim=-1)


def _top_k(logits: torch.Tensor, ks: list[int]) -> None:
    """Mask all but each row's top k logits (ties with the k-th are kept); rows with 0 keep all."""
    widest = max(ks)
    index = torch.tensor([k - 1 if k else widest - 1 for k in ks], device=logits.device)
    kth = logits.topk(widest, dim=-1).values.gather(1, index[:, None])
    kth[torch.tensor([k == 0 for k in ks], device=logits.device)] = float("-inf")
    logits.masked_fill_(logits < kth, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams], ks: list[int]) -> torch.Tensor:
    # A stable sort breaks ties by token id, so a row's result does not depend on its batch.
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    if any(ks):
        k = torch.tensor([k or vocab for k in ks], device=logits.device)
        rank = torch.arange(vocab, device=logits.device)
        ordered.masked_fill_(rank >= k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    # Drop a token once the likelier ones reach top_p; the likeliest always stays. A top_p of 1
    # becomes infinite so that rounding in the cumulative sum never drops the tail.
    top_p = torch.tensor(
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=logits.device
    )
    ordered.masked_fill_(probs.cumsum(dim=-1) - probs >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)


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

"""Output processing: each step's tokens detokenized and checked for stops, deadlines enforced,
and the outputs callers asked for built; one `StepStats` per step for the loggers.

A caller's request is one `_RequestState`: its `n` completions, each an engine `Request` with
its detokenizer. A state is "moved" when one of its completions was scheduled, got a token, or
ended since its last output; only moved states are looked at, in the order their requests were
added. What a moved state hands back follows its `RequestOutputKind`:

- CUMULATIVE: an output every time it moves, with every completion's text, token ids and
  logprobs so far (copied: callers keep them).
- DELTA: an output when a completion has something new, with only those completions and only
  what is new in each (text, token ids and logprobs since the previous output); a completion's
  last delta carries its finish reason. Nothing is copied but the new parts.
- FINAL_ONLY: one output, once every completion has finished, as CUMULATIVE's last.

The `finished` output is always the last of a request, and the request is then forgotten: its
id may be used again. An embedding request (PoolingParams) has one output, whatever its kind:
the finished one, with its vector and no completions.
"""

from __future__ import annotations

import heapq
import itertools
import time
import weakref
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagedbatch.engine.core.request import Request, RequestStatus, TokenLogprob
from pagedbatch.engine.detokenizer import IncrementalDetokenizer
from pagedbatch.engine.engine_core import CoreOutput, EngineCore, SampledToken
from pagedbatch.engine.metrics.step import StepStats
from pagedbatch.engine.multimodal.inputs import media_tokens
from pagedbatch.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedbatch.engine.sampling_params import RequestOutputKind


@dataclass(eq=False)  # compared by identity: its completions point back at it
class _RequestState:
    request_id: str
    order: int  # when it was added: outputs come in this order
    kind: RequestOutputKind
    completions: list[_Completion] = field(default_factory=list)
    sent_prompt_logprobs: bool = False  # DELTA: an output carried them


@dataclass(eq=False)
class _Completion:
    state: _RequestState = field(repr=False)
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None for an embedding request
    # DELTA: how much of the completion earlier outputs handed over.
    sent_tokens: int = 0  # token ids, and logprobs when asked for (one per token)
    sent_chars: int = 0
    sent_finished: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, core: EngineCore):
        self.tokenizer = tokenizer
        self.core = core  # ends requests: stops, timeouts, aborts, failures
        self._states: dict[str, _RequestState] = {}
        self._completions: dict[str, _Completion] = {}  # by engine request id
        self._moved: dict[str, _RequestState] = {}
        # (deadline, tie-breaker, request): a weak reference, so that a request that finished
        # long before its deadline is not kept alive by it.
        self._deadlines: list[tuple[float, int, weakref.ref[Request]]] = []
        self._order = itertools.count()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def live_requests(self) -> list[Request]:
        """The completions of the requests followed that have not finished."""
        return [c.request for c in self._completions.values() if not c.request.finished]

    def add(self, request_id: str, completions: list[Request]) -> None:
        """Follow a request's completions (all with the same params but for their seeds)."""
        first = completions[0]
        pooling = first.pooling_params is not None
        kind = first.pooling_params.output_kind if pooling else first.sampling_params.output_kind
        state = _RequestState(request_id, next(self._order), kind)
        for i, request in enumerate(completions):
            detok = (
                None if pooling else IncrementalDetokenizer(self.tokenizer, request.sampling_params)
            )
            completion = _Completion(state, i, request, detok)
            state.completions.append(completion)
            self._completions[request.request_id] = completion
            if request.deadline is not None:
                entry = (request.deadline, next(self._order), weakref.ref(request))
                heapq.heappush(self._deadlines, entry)
        self._states[request_id] = state
        self._moved[request_id] = state

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its completions). False if it is unknown or done."""
        state = self._states.get(request_id)
        if state is None:
            return False
        for completion in state.completions:
            if not completion.request.finished:
                self.core.finish(completion.request, RequestStatus.FINISHED_ABORTED)
        self._moved[request_id] = state
        return True

    def expire_deadlines(self, now: float) -> None:
        """Abort, with "request timed out", every live completion whose deadline has come."""
        while self._deadlines and self._deadlines[0][0] <= now:
            request = heapq.heappop(self._deadlines)[2]()
            if request is not None and not request.finished:
                request.error = "request timed out"
                self.core.finish(request, RequestStatus.FINISHED_ABORTED)
                self._mark_moved(request)

    def process(self, step: CoreOutput, began: float) -> tuple[list[RequestOutput], StepStats]:
        """The outputs of the requests that moved in `step` (which began at `began`), and the
        step's stats."""
        now = time.monotonic()
        stats = StepStats(
            began=began,
            ended=now,
            num_seqs=len(step.scheduled),
            num_tokens=step.num_tokens,
            busy_seconds=0.0,
            preemptions=step.preemptions,
            deferred_tokens=step.deferred_tokens,
            prefix_queries=step.prefix_queries,
            prefix_hits=step.prefix_hits,
            media_encoded=step.media_encoded,
            encoder_cache_hits=step.encoder_cache_hits,
        )
        for scheduled in step.scheduled:
            self._mark_moved(scheduled.request)
        for request in step.failed:
            self._mark_moved(request)
        for sampled in step.sampled:
            self._process_token(sampled, now, stats)
        for request in step.pooled:
            stats.prompt_tokens += request.num_prompt_tokens
        if step.scheduled:
            stats.busy_seconds = time.perf_counter() - step.run_started
        outputs = []
        for state in sorted(self._moved.values(), key=lambda state: state.order):
            output = self._output(state)
            if output is None:
                continue
            outputs.append(output)
            if output.finished:
                self._retire(state, stats)
        self._moved.clear()
        scheduler = self.core.scheduler
        stats.running, stats.waiting = len(scheduler.running), len(scheduler.waiting)
        stats.kv_usage = self.core.kv.pool.usage
        stats.ended = time.monotonic()
        return outputs, stats

    def _mark_moved(self, request: Request) -> None:
        state = self._completions[request.request_id].state
        self._moved[state.request_id] = state

    def _process_token(self, sampled: SampledToken, now: float, stats: StepStats) -> None:
        request, token = sampled.request, sampled.token
        stats.generation_tokens += 1
        if request.last_token_time is None:
            stats.prompt_tokens += request.num_prompt_tokens
            request.first_token_time = now
        else:
            gap = now - request.last_token_time
            stats.token_gaps.setdefault(request.priority, []).append(gap)
        request.last_token_time = now
        self._mark_moved(request)
        try:
            stop_string = self._completions[request.request_id].detokenizer.update([token])
        except Exception as e:  # noqa: BLE001 - reported to the request's caller
            if not request.finished:
                self.core.fail(request, str(e), e)
            return
        if request.finished:  # the core failed it: its grammar refused the token
            return
        status = _stop_status(request, token, stop_string, sampled.grammar_ended)
        if status is not None:
            self.core.finish(request, status)

    def _output(self, state: _RequestState) -> RequestOutput | None:
        if state.completions[0].detokenizer is None:
            return _pooling_output(state)
        finished, error = True, None
        for completion in state.completions:
            request, detok = completion.request, completion.detokenizer
            if not request.finished:
                finished = False
                continue
            if not detok.finished:
                try:
                    detok.update([], final=True)  # release any held-back text
                except Exception as e:  # noqa: BLE001 - reported to the request's caller
                    self.core.fail(request, f"detokenizing failed: {e}", e)
            error = error or request.error
        if state.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if state.kind is RequestOutputKind.DELTA:
            completions = [c for c in map(_delta, state.completions) if c is not None]
            if not completions and not finished:
                return None
        else:
            completions = [_cumulative(c) for c in state.completions]
        first = state.completions[0].request
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            prompt_logprobs=_prompt_logprobs(state),
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            num_image_tokens=media_tokens(first.media, "image"),
            num_audio_tokens=media_tokens(first.media, "audio"),
            error=error,
            metrics=_metrics(first),
        )

    def _retire(self, state: _RequestState, stats: StepStats) -> None:
        del self._states[state.request_id]
        for completion in state.completions:
            request = completion.request
            del self._completions[request.request_id]
            self.core.release(request)
            stats.finished.append(request)


def _pooling_output(state: _RequestState) -> RequestOutput | None:
    """An embedding request's one output, once it has finished."""
    request = state.completions[0].request
    if not request.finished:
        return None
    return RequestOutput(
        request_id=state.request_id,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[],
        finished=True,
        num_cached_tokens=request.num_cached_tokens,
        error=request.error,
        metrics=_metrics(request),
        embedding=request.embedding,
    )


def _prompt_logprobs(state: _RequestState) -> list[TokenLogprob | None] | None:
    """The prompt's logprobs, once its first completion has scored all of it (None for its first
    token); a DELTA request's only in its first output that has them."""
    request = state.completions[0].request
    if not request.scores_prompt or len(request.prompt_logprobs) < request.num_prompt_tokens - 1:
        return None
    if state.kind is RequestOutputKind.DELTA:
        if state.sent_prompt_logprobs:
            return None
        state.sent_prompt_logprobs = True
    return [None, *request.prompt_logprobs]


def _cumulative(completion: _Completion) -> CompletionOutput:
    request = completion.request
    return CompletionOutput(
        index=completion.index,
        text=completion.detokenizer.stable_text,
        token_ids=list(request.output_token_ids),
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=(
            list(request.output_logprobs) if request.sampling_params.logprobs is not None else None
        ),
        scores=request.scores,
    )


def _delta(completion: _Completion) -> CompletionOutput | None:
    """What is new in the completion since its previous delta; None if nothing is."""
    request, detok = completion.request, completion.detokenizer
    tokens, chars, finished = request.num_output_tokens, detok.num_stable_chars, request.finished
    newly_finished = finished and not completion.sent_finished
    if tokens == completion.sent_tokens and chars == completion.sent_chars and not newly_finished:
        return None
    start = completion.sent_tokens
    logprobs = request.sampling_params.logprobs is not None
    output = CompletionOutput(
        index=completion.index,
        text=detok.stable_text_from(completion.sent_chars),
        token_ids=request.output_token_ids[start:],
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=request.output_logprobs[start:] if logprobs else None,
        scores=request.scores if start == 0 else None,
    )
    completion.sent_tokens, completion.sent_chars = tokens, chars
    completion.sent_finished = finished
    return output


def _stop_status(
    request: Request, token: int, stop_string: str | None, grammar_ended: bool
) -> RequestStatus | None:
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if stop_string is not None:
            request.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if token in request.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if grammar_ended:  # the output is complete: nothing but a stop token could follow
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def _metrics(request: Request) -> RequestMetrics:
    def since_arrival(t: float | None) -> float | None:
        return None if t is None else t - request.arrival_time

    n = request.num_output_tokens
    mean_itl = None
    if n > 1 and request.first_token_time is not None and request.last_token_time is not None:
        mean_itl = (request.last_token_time - request.first_token_time) / (n - 1)
    return RequestMetrics(
        arrival_time=request.arrival_time,
        queue_time=since_arrival(request.first_scheduled_time),
        ttft=since_arrival(request.first_token_time),
        e2e=since_arrival(request.finished_time),
        mean_itl=mean_itl,
    )

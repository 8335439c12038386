"""The core step: schedule, run the model, sample; and the requests' lives in the scheduler.

The core knows requests, not what callers asked to see of them: it appends each sampled token
(and its logprob) to its request and advances the request's grammar, and leaves detokenizing,
stop checks and outputs to output processing. It ends a request itself only when the request
cannot go on (its grammar or its sampling failed): that request ends alone, with an error, and
is reported in the next `CoreOutput.failed`; and an embedding model's request when its prompt
has run: its vector is made and its KV blocks, if it had any, freed in that step. Only the
engine thread calls it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from pagedbatch.engine.config import EngineArgs, ModelConfig
from pagedbatch.engine.core.encoder_cache import EncoderCache
from pagedbatch.engine.core.kv_cache_manager import KVCacheManager
from pagedbatch.engine.core.request import Request, RequestStatus, TokenLogprob
from pagedbatch.engine.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from pagedbatch.engine.core.step_cost import StepCostModel, StepWork
from pagedbatch.engine.sample import prompt_logprobs
from pagedbatch.engine.sample.grammar_runtime import GrammarRuntime
from pagedbatch.engine.sample.sampler import Sampler, edits_logits
from pagedbatch.engine.sample.structured_output import StructuredOutput
from pagedbatch.engine.worker.model_runner import ModelRunner
from pagedbatch.engine.worker.pooler import finish_embeddings
from pagedbatch.engine.worker.ranks import start_runner

logger = logging.getLogger(__name__)

# How long an engine with nothing else to run waits for a grammar before stepping again.
GRAMMAR_WAIT_SECONDS = 0.05


@dataclass
class SampledToken:
    """A token the step appended to its request."""

    request: Request
    token: int
    grammar_ended: bool  # it completed the request's structured output


@dataclass
class CoreOutput:
    """What one core step did."""

    scheduled: list[ScheduledRequest]
    num_tokens: int
    sampled: list[SampledToken]
    failed: list[Request]  # requests the core ended with an error since the last step
    preemptions: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which found
    run_started: float  # perf_counter when the model run began (after scheduling)
    media_encoded: int = 0  # images and clips the step gave the encoder
    encoder_cache_hits: int = 0  # items whose embeddings it found cached
    pooled: list[Request] = field(default_factory=list)  # embedding requests it finished
    deferred_tokens: int = 0  # lower-priority tokens left to later steps (SchedulerOutput's)


@dataclass
class _Compiling:
    """Completions of one request waiting for their grammar, outside the scheduler until then."""

    requests: list[Request]
    grammar: Future


class EngineCore:
    def __init__(
        self,
        model_config: ModelConfig,
        args: EngineArgs,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: frozenset[int],
    ):
        self.runner: ModelRunner = start_runner(model_config, args)
        self.pooling = model_config.pooling  # an embedding model's; it samples nothing
        self.encoder_only = model_config.encoder_only
        self.kv = KVCacheManager(
            self.runner.num_blocks, args.block_size, args.enable_prefix_caching
        )
        # Steps are measured only where the scheduler uses the measure: to size the steps that
        # realtime requests wait on.
        priority = args.scheduling_policy == "priority"
        self.step_cost = StepCostModel() if priority else None
        target_ms = args.realtime_target_itl_ms
        # Image and audio embeddings, for a model that reads either.
        multimodal = model_config.multimodal is not None
        self.encoder_cache = EncoderCache(args.encoder_cache_size) if multimodal else None
        self.scheduler = Scheduler(
            self.kv,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.scheduling_policy,
            args.low_priority_token_budget,
            target_ms / 1000 if target_ms is not None else None,
            self.step_cost,
            self.encoder_cache,
            args.max_num_encoder_tokens,
            model_config.encoder_only,
            # Adapters in one step: as many as the runner has slots for.
            args.max_loras if self.runner.loras is not None else None,
        )
        self.grammars = GrammarRuntime(
            tokenizer, model_config.vocab_size, eos_token_ids, args.grammar_compile_seconds
        )
        self.sampler = Sampler(self.grammars.apply_masks)
        self._compiling: list[_Compiling] = []
        self._failed: list[Request] = []
        # The last step's kind, work and start: the next step's start ends its iteration (see
        # `pause`).
        self._last_step: tuple[str, StepWork, float] | None = None

    # Requests ----------------------------------------------------------------------------------

    def add(self, requests: list[Request], structured: StructuredOutput | None) -> None:
        """Admit one request's completions; with structured output, once its grammar compiled."""
        # Laned and cached by cache salt: the tenant's, unless tenants share the prefix cache.
        salt = requests[0].cache_salt
        grammar = self.grammars.compile(structured, salt) if structured is not None else None
        if grammar is None or grammar.done():
            self._schedule(requests, grammar)
        else:
            self._compiling.append(_Compiling(requests, grammar))

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a live request (stopped, length, aborted), releasing its blocks."""
        self.scheduler.finish(request, status)

    def fail(self, request: Request, error: str, cause: Exception | None = None) -> None:
        """End one request with an error; the others, and the engine, go on."""
        logger.warning("request %s failed: %s", request.request_id, error, exc_info=cause)
        request.error = error
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)

    def release(self, request: Request) -> None:
        """Drop what is kept for a finished request's sampling (its grammar, its token counts)."""
        self.grammars.release(request.request_id)
        self.sampler.release(request.request_id)

    def pause(self) -> None:
        """The engine has no work left: the next step follows a wait, which no token of the
        last step waited on."""
        self._last_step = None

    def _fail_own(self, request: Request, error: str, cause: Exception | None = None) -> None:
        """`fail`, for a request the core ends itself: reported in the next step's output."""
        self.fail(request, error, cause)
        self._failed.append(request)

    def _schedule(self, requests: list[Request], grammar: Future | None) -> None:
        """Hand completions to the scheduler, each with a matcher if it has a grammar."""
        error = grammar.exception() if grammar is not None else None
        for request in requests:
            if request.finished:  # aborted or timed out while its grammar compiled
                continue
            if error is not None:
                self._fail_own(request, f"grammar compilation failed: {error}")
                continue
            if grammar is not None:
                try:
                    params = request.sampling_params
                    structured = None if params is None else params.structured
                    after = None if structured is None else structured.starts_after
                    self.grammars.start(request.request_id, grammar.result(), after)
                except Exception as e:  # noqa: BLE001 - reported to the request's caller
                    self._fail_own(request, f"grammar failed: {e}", e)
                    continue
            self.scheduler.add(request)

    def _schedule_compiled(self) -> None:
        if not self._compiling:
            return
        if not self.scheduler.num_unfinished:
            # Nothing else to run: wait for a grammar rather than spin.
            pending = [compiling.grammar for compiling in self._compiling]
            wait(pending, timeout=GRAMMAR_WAIT_SECONDS, return_when=FIRST_COMPLETED)
        ready = [compiling for compiling in self._compiling if compiling.grammar.done()]
        self._compiling = [c for c in self._compiling if not c.grammar.done()]
        for compiling in ready:
            self._schedule(compiling.requests, compiling.grammar)

    # The step ----------------------------------------------------------------------------------

    def step(self) -> CoreOutput:
        began = time.perf_counter()
        if self._last_step is not None:  # what a token of the last step waited on
            kind, work, last_began = self._last_step
            self.step_cost.observe_iteration(kind, work, began - last_began)
        self._schedule_compiled()
        pool = self.kv.pool
        queries, hits = pool.prefix_queries, pool.prefix_hits
        encoded, cached = self._encoder_counts()
        out = self.scheduler.schedule()
        if self.runner.loras is not None:
            self._prepare_loras(out)
        run_started = time.perf_counter()
        sampled: list[SampledToken] = []
        pooled: list[Request] = []
        if out.scheduled:
            if self.encoder_only:
                block_tables = np.zeros((len(out.scheduled), 0), dtype=np.int32)
            else:
                ids = [s.request.request_id for s in out.scheduled]
                block_tables = self.kv.block_table.gather(ids)
            encoder = self.encoder_cache.take_work() if self.encoder_cache is not None else None
            sampling = [s.request for s in out.scheduled if s.samples]
            # Rows that want their argmax alone: the runner makes the tokens (sample/greedy).
            greedy = self.pooling is None and not (
                edits_logits(sampling) or any(map(_wants_scores, sampling))
            )
            logits = self.runner.execute(out.scheduled, block_tables, encoder, greedy)
            scored, self.runner.scored_prompt = self.runner.scored_prompt, None
            if scored is not None:
                prompt_logprobs.record(out.scheduled, scored)
            if self.pooling is not None:
                pooled = self._pool(out.scheduled, logits)
            else:
                if greedy:
                    chosen = [(token, None) for token in logits.tolist()]
                else:
                    _keep_scores(logits, sampling)
                    chosen = self._sample(logits, sampling)
                for request, (token, logprob) in zip(sampling, chosen, strict=True):
                    if token is not None:
                        sampled.append(self._append(request, token, logprob))
            if self.step_cost is not None:
                self.step_cost.observe(out.work, time.perf_counter() - run_started)
        measured = self.step_cost is not None and out.kind is not None
        self._last_step = (out.kind, out.work, began) if measured else None
        failed, self._failed = self._failed, []
        encoded_after, cached_after = self._encoder_counts()
        return CoreOutput(
            scheduled=out.scheduled,
            num_tokens=out.num_tokens,
            sampled=sampled,
            failed=failed,
            preemptions=len(out.preempted),
            prefix_queries=pool.prefix_queries - queries,
            prefix_hits=pool.prefix_hits - hits,
            run_started=run_started,
            media_encoded=encoded_after - encoded,
            encoder_cache_hits=cached_after - cached,
            pooled=pooled,
            deferred_tokens=out.deferred_tokens,
        )

    def _prepare_loras(self, out: SchedulerOutput) -> None:
        """The step's LoRA adapters swapped into slots; the requests of one whose folder, read
        again, failed end with that error (the adapter is unregistered) and leave the step."""
        names = {s.request.lora_name for s in out.scheduled} - {None}
        failed = self.runner.loras.prepare(names)
        if not failed:
            return
        for s in out.scheduled:
            if s.request.lora_name in failed:
                self._fail_own(s.request, failed[s.request.lora_name])
        out.scheduled = [s for s in out.scheduled if s.request.lora_name not in failed]

    def _pool(self, scheduled: list[ScheduledRequest], rows: torch.Tensor) -> list[Request]:
        """Fold each chunk's pooled row into its request; finish the requests whose prompts
        have now run (their vectors made, their blocks freed). Returns those."""
        pooling_type = self.pooling.pooling_type
        done: list[Request] = []
        for s, row in zip(scheduled, rows, strict=True):
            request = s.request
            if pooling_type == "mean":
                request.pooled = row if request.pooled is None else request.pooled + row
            elif pooling_type == "last" or s.start == 0:  # cls: the first chunk's first row
                request.pooled = row
            if s.end == request.num_tokens:
                done.append(request)
        if not done:
            return done
        vectors = finish_embeddings(
            torch.stack([r.pooled for r in done]),
            [r.num_prompt_tokens for r in done],
            pooling_type == "mean",
            [r.dimensions for r in done],
            [_normalizes(r, self.pooling.normalize) for r in done],
        )
        for request, vector in zip(done, vectors, strict=True):
            request.embedding, request.pooled = vector, None
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        return done

    def _encoder_counts(self) -> tuple[int, int]:
        """Images and clips encoded, and encoder-cache hits, so far."""
        cache = self.encoder_cache
        return (cache.media_encoded, cache.cache_hits) if cache is not None else (0, 0)

    def _sample(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> list[tuple[int | None, TokenLogprob | None]]:
        """Sample the batch at once; should that fail (a logits processor, a grammar matcher, a
        request's settings), sample row by row so that only the rows that fail again are lost:
        each such request ends with an error, and the engine goes on."""
        # The sampler edits logits in place and may fail half-way: keep them for the retry.
        pristine = logits.clone() if edits_logits(requests) else logits
        try:
            return self.sampler(logits, requests)
        except Exception:  # noqa: BLE001 - narrowed down to the failing requests below
            logger.exception("sampling failed; sampling its %d rows one by one", len(requests))
        results: list[tuple[int | None, TokenLogprob | None]] = []
        for i, request in enumerate(requests):
            try:
                results.extend(self.sampler(pristine[i : i + 1].clone(), [request]))
            except Exception as e:  # noqa: BLE001 - reported to the request's caller
                self._fail_own(request, f"sampling failed: {e}", e)
                results.append((None, None))
        return results

    def _append(self, request: Request, token: int, logprob: TokenLogprob | None) -> SampledToken:
        """The token joins its request and advances its grammar; a token the grammar refuses
        (a logits processor unmasked it) fails the request, the token kept."""
        request.append_output_token(token)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        try:
            ended = self.grammars.accept(request.request_id, token)
        except Exception as e:  # noqa: BLE001 - e.g. a GrammarViolation; reported to the caller
            self._fail_own(request, str(e), e)
            ended = False
        return SampledToken(request, token, ended)


def _normalizes(request: Request, default: bool) -> bool:
    asked = request.pooling_params.normalize
    return default if asked is None else asked


def _wants_scores(request: Request) -> bool:
    """Whether the request keeps the logits it samples its first token from (as `scores`)."""
    return request.sampling_params.scores and not request.output_token_ids


def _keep_scores(logits: torch.Tensor, requests: list[Request]) -> None:
    """The rows that requests asking for scores sample their first token from, as they are
    before sampling edits them."""
    for i, request in enumerate(requests):
        if _wants_scores(request):
            request.scores = logits[i].clone()

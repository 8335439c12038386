"""The engine loop: admit requests, schedule a step, run it, sample, detokenize, stop, report."""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pagedbatch.engine.config import EngineArgs, ModelConfig
from pagedbatch.engine.detokenizer import IncrementalDetokenizer
from pagedbatch.engine.kv_cache_manager import KVCacheManager, cdiv
from pagedbatch.engine.metrics import EngineMetrics
from pagedbatch.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedbatch.engine.ranks import start_runner
from pagedbatch.engine.request import Request, RequestStatus, TokenLogprob
from pagedbatch.engine.sampler import Sampler, edits_logits
from pagedbatch.engine.sampling_params import SamplingParams
from pagedbatch.engine.scheduler import Scheduler
from pagedbatch.engine.stats import EngineStats
from pagedbatch.engine.stats_logger import Snapshot, StatsLogger
from pagedbatch.engine.structured_output import GrammarRuntime
from pagedbatch.engine.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

# How long an engine with nothing else to run waits for a grammar before stepping again.
GRAMMAR_WAIT_SECONDS = 0.05


@dataclass
class _Group:
    """A user's request: `n` engine requests (one per completion) sharing a prompt."""

    request_id: str
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    dirty: bool = True  # moved since its last reported output
    grammar: Future | None = None  # structured output: its children wait for it to compile


class LLMEngine:
    def __init__(self, args: EngineArgs):
        model_dir = Path(args.model)
        self.args = args
        self.model_config = ModelConfig.from_dir(model_dir)
        self.model_name = args.served_model_name or model_dir.resolve().name
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_token_ids = eos_token_ids(model_dir, self.tokenizer)
        limit = self.model_config.max_position_embeddings
        if args.max_model_len is not None and args.max_model_len > limit:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's {limit}")
        self.max_model_len = args.max_model_len or limit
        self.runner = start_runner(self.model_config, args)
        self.kv = KVCacheManager(
            self.runner.num_blocks, args.block_size, args.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.scheduling_policy,
            args.low_priority_token_budget,
        )
        self.grammars = GrammarRuntime(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
        )
        self.sampler = Sampler(self.grammars.apply_masks)
        self.stats = EngineStats()
        self.metrics = EngineMetrics(self.model_name, self.kv, self.scheduler)
        interval = args.stats_log_interval_seconds
        self.stats_logger = StatsLogger(self.model_name, interval) if interval else None
        self._groups: dict[str, _Group] = {}
        self._child_group: dict[str, _Group] = {}
        self._compiling: list[_Group] = []  # admitted to the scheduler once their grammar is ready
        self._ids = itertools.count()
        torch.manual_seed(args.seed)

    # Admission -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; raises ValueError naming the problem if it cannot run.

        Requests share prefix-cache blocks only when their `cache_salt`s are equal (None
        included): a tenant's salt keeps others from learning, through cached_tokens, what it sent.
        """
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = self._encode(prompt)
        max_tokens = self._resolve_max_tokens(len(prompt_ids), params)
        self._check_vocabulary(params)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        now = time.monotonic()
        children, detoks = [], []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=params.seed + i)
            child = Request(
                request_id=f"{request_id}#{i}",
                prompt_token_ids=prompt_ids,
                sampling_params=child_params,
                eos_token_ids=self.eos_token_ids,
                priority=priority,
                arrival_time=now,
                deadline=now + timeout if timeout is not None else None,
                max_tokens=max_tokens,
                cache_salt=cache_salt,
            )
            children.append(child)
            detoks.append(IncrementalDetokenizer(self.tokenizer, child_params))
        grammar = self.grammars.compile(params.structured) if params.structured else None
        group = _Group(request_id, children, detoks, grammar=grammar)
        self._groups[request_id] = group
        for child in children:
            self._child_group[child.request_id] = group
        if grammar is None or grammar.done():
            self._schedule(group)
        else:
            self._compiling.append(group)
        return request_id

    def _schedule(self, group: _Group) -> None:
        """Hand a group's children to the scheduler, each with a matcher if it has a grammar."""
        error = group.grammar.exception() if group.grammar is not None else None
        for child in group.children:
            if child.finished:  # aborted or timed out while its grammar compiled
                continue
            if error is not None:
                self._fail(child, f"grammar compilation failed: {error}")
                continue
            if group.grammar is not None:
                try:
                    self.grammars.start(child.request_id, group.grammar.result())
                except Exception as e:  # noqa: BLE001 - reported to the request's caller
                    self._fail(child, f"grammar failed: {e}", e)
                    continue
            self.scheduler.add(child)

    def _schedule_compiled(self) -> None:
        if not self._compiling:
            return
        if not self.scheduler.num_unfinished:
            # Nothing else to run: wait for a grammar rather than spin.
            pending = [group.grammar for group in self._compiling]
            wait(pending, timeout=GRAMMAR_WAIT_SECONDS, return_when=FIRST_COMPLETED)
        ready = [group for group in self._compiling if group.grammar.done()]
        self._compiling = [group for group in self._compiling if not group.grammar.done()]
        for group in ready:
            self._schedule(group)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("prompt is empty")
        return ids

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """Token ids in the params must name rows of the logits (SamplingParams checks the rest)."""
        vocab = self.model_config.vocab_size
        named = {"stop_token_ids": params.stop_token_ids, "logit_bias": params.logit_bias}
        for name, ids in named.items():
            bad = next((t for t in ids or () if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(
                    f"{name} holds token id {bad}, outside the vocabulary (size {vocab})"
                )

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {prompt_len} tokens"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {prompt_len} and max_tokens asks for {params.max_tokens} more"
            )
        max_tokens = params.max_tokens or room
        blocks = cdiv(prompt_len + max_tokens, self.kv.block_size)
        if blocks > self.kv.pool.num_blocks:
            raise ValueError(
                f"prompt plus max_tokens ({prompt_len + max_tokens} tokens) exceeds the KV cache "
                f"({self.kv.pool.num_blocks * self.kv.block_size} tokens)"
            )
        return max_tokens

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its completions). Returns False if it is unknown or done."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for child in group.children:
            if not child.finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
        group.dirty = True
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def shutdown(self) -> None:
        """Stops the engine's other tensor-parallel ranks, if any; the engine runs no more."""
        self.runner.shutdown()

    # The step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of the requests that moved."""
        began = time.monotonic()
        self._expire_deadlines()
        self._schedule_compiled()
        out = self.scheduler.schedule()
        started = time.perf_counter()
        if out.scheduled:
            block_tables = [self.kv.block_ids(s.request.request_id) for s in out.scheduled]
            logits = self.runner.execute(out.scheduled, block_tables)
            sampling = [s.request for s in out.scheduled if s.samples]
            for request, (token, logprob) in zip(
                sampling, self._sample(logits, sampling), strict=True
            ):
                if token is not None:
                    self._append_token(request, token, logprob)
            for s in out.scheduled:
                self._child_group[s.request.request_id].dirty = True
        self.stats.record_step(
            num_tokens=out.num_tokens,
            num_seqs=len(out.scheduled),
            seconds=time.perf_counter() - started,
        )
        self.metrics.record_step(out.num_tokens)
        if self.stats_logger is not None:
            self.stats_logger.step(began, self._snapshot())
        return self._collect_outputs()

    def idle(self) -> None:
        """For a loop that waits for work: lets the stats line of the last burst out on time."""
        if self.stats_logger is not None:
            self.stats_logger.idle(time.monotonic())

    def _snapshot(self) -> Snapshot:
        return Snapshot(
            time=time.monotonic(),
            totals=self.metrics.totals,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.pool.usage,
        )

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
                self._fail(request, f"sampling failed: {e}", e)
                results.append((None, None))
        return results

    def _fail(self, request: Request, error: str, cause: Exception | None = None) -> None:
        """End one request with an error; the others, and the engine, go on."""
        logger.warning("request %s failed: %s", request.request_id, error, exc_info=cause)
        request.error = error
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        self._child_group[request.request_id].dirty = True

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        now = time.monotonic()
        self.metrics.record_token(request, now)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        request.output_token_ids.append(token)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        self.stats.generation_tokens += 1
        group = self._child_group[request.request_id]
        detok = group.detokenizers[group.children.index(request)]
        try:
            stop_string = detok.update([token])
            grammar_ended = self.grammars.accept(request.request_id, token)
        except Exception as e:  # noqa: BLE001 - e.g. a GrammarViolation; reported to the caller
            self._fail(request, str(e), e)
            return
        status = self._stop_status(request, token, stop_string, grammar_ended)
        if status is not None:
            self.scheduler.finish(request, status)

    def _stop_status(
        self, request: Request, token: int, stop_string: str | None, grammar_ended: bool
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

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for group in list(self._groups.values()):
            for child in group.children:
                if not child.finished and child.deadline is not None and now >= child.deadline:
                    child.error = "request timed out"
                    self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
                    group.dirty = True

    # Reporting ---------------------------------------------------------------------------------

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for group in list(self._groups.values()):
            if not group.dirty:
                continue
            group.dirty = False
            output = self._group_output(group)
            outputs.append(output)
            if output.finished:
                self._retire(group)
        return outputs

    def _group_output(self, group: _Group) -> RequestOutput:
        completions = []
        for i, (child, detok) in enumerate(zip(group.children, group.detokenizers, strict=True)):
            params = child.sampling_params
            if child.finished and not detok.finished:
                try:
                    detok.update([], final=True)  # release any held-back text
                except Exception as e:  # noqa: BLE001 - reported to the request's caller
                    self._fail(child, f"detokenizing failed: {e}", e)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=detok.stable_text,
                    token_ids=list(child.output_token_ids),
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                    logprobs=list(child.output_logprobs) if params.logprobs is not None else None,
                )
            )
        first = group.children[0]
        finished = all(c.finished for c in group.children)
        errors = [c.error for c in group.children if c.error]
        return RequestOutput(
            request_id=group.request_id,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            error=errors[0] if errors else None,
            metrics=_metrics(first),
        )

    def _retire(self, group: _Group) -> None:
        del self._groups[group.request_id]
        for child in group.children:
            del self._child_group[child.request_id]
            self.grammars.release(child.request_id)
            self.stats.record_finished(child)
            self.metrics.record_finished(child)

    def get_stats(self) -> dict:
        pool = self.kv.pool
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_kv_blocks": pool.num_free_blocks,
            "total_kv_blocks": pool.num_blocks,
            "kv_usage": pool.usage,
            "prefix_cache_queries": pool.prefix_queries,
            "prefix_cache_hits": pool.prefix_hits,
            "preemptions": self.scheduler.num_preemptions,
            **self.stats.as_dict(),
        }


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

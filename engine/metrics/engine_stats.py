"""Running totals and recent latency figures, as the plain dict `get_stats()` returns: a logger
on the engine's list."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from pagedbatch.engine.core.request import Request
from pagedbatch.engine.metrics.step import StatLogger, StepStats

RECENT = 1000  # finished requests kept for latency percentiles


def _percentiles(values: deque[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


@dataclass
class EngineStats(StatLogger):
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of finished requests
    generation_tokens: int = 0
    batched_tokens: int = 0  # tokens run through the model, recomputation included
    finished_requests: int = 0
    busy_seconds: float = 0.0
    batch_tokens_deferred: int = 0  # left to later steps by steps sized for realtime requests
    steps_shortened: int = 0  # such steps that left any
    ttft: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    itl: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    queue_time: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    e2e: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))

    def record(self, stats: StepStats) -> None:
        if stats.num_seqs:
            self.steps += 1
            self.batched_tokens += stats.num_tokens
            self.busy_seconds += stats.busy_seconds
        self.generation_tokens += stats.generation_tokens
        if stats.deferred_tokens:
            self.batch_tokens_deferred += stats.deferred_tokens
            self.steps_shortened += 1
        for request in stats.finished:
            self._record_finished(request)

    def _record_finished(self, request: Request) -> None:
        self.finished_requests += 1
        self.prompt_tokens += request.num_prompt_tokens
        start = request.arrival_time
        if request.first_scheduled_time is not None:
            self.queue_time.append(request.first_scheduled_time - start)
        if request.first_token_time is not None:
            self.ttft.append(request.first_token_time - start)
            if request.num_output_tokens > 1 and request.last_token_time is not None:
                span = request.last_token_time - request.first_token_time
                self.itl.append(span / (request.num_output_tokens - 1))
        if request.finished_time is not None:
            self.e2e.append(request.finished_time - start)

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "batched_tokens": self.batched_tokens,
            "finished_requests": self.finished_requests,
            "busy_seconds": self.busy_seconds,
            "batch_tokens_deferred": self.batch_tokens_deferred,
            "steps_shortened": self.steps_shortened,
            "ttft_seconds": _percentiles(self.ttft),
            "itl_seconds": _percentiles(self.itl),
            "queue_seconds": _percentiles(self.queue_time),
            "e2e_seconds": _percentiles(self.e2e),
        }

"""The periodic stats line, as vLLM logs it: throughput, running and waiting requests, KV-cache
usage and prefix-cache hit rate, once every `interval` seconds while the engine has work.

A logger on the engine's list: it takes each step's stats at the end of the step and costs a few
additions and a clock comparison unless a line is due. An
engine with nothing to do is not stepped; so that the quiet time does not dilute the throughput,
once it has been idle for an interval the window it left open is closed (logged) at its last
step, and a new one opens when work resumes. `idle()` lets an engine loop that waits for work
close it on time, so that a short burst is logged soon after it ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedbatch.engine.metrics.step import StatLogger, StepStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Totals:
    """An engine's running totals since it started."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


@dataclass(frozen=True)
class Snapshot:
    """The engine at the end of a step."""

    time: float  # monotonic seconds
    totals: Totals
    running: int
    waiting: int
    kv_usage: float


class StatsLogger(StatLogger):
    def __init__(self, model_name: str, interval: float):
        self.model_name = model_name
        self.interval = interval
        self._totals = Totals()
        self._start: Snapshot | None = None  # where the window being measured began
        self._last: Snapshot | None = None  # the latest step

    def record(self, stats: StepStats) -> None:
        totals = self._totals
        self._totals = Totals(
            prompt_tokens=totals.prompt_tokens + stats.prompt_tokens,
            generation_tokens=totals.generation_tokens + stats.generation_tokens,
            prefix_queries=totals.prefix_queries + stats.prefix_queries,
            prefix_hits=totals.prefix_hits + stats.prefix_hits,
        )
        snapshot = Snapshot(stats.ended, self._totals, stats.running, stats.waiting, stats.kv_usage)
        self.step(stats.began, snapshot)

    def step(self, started: float, snapshot: Snapshot) -> None:
        """Account for a step that began at `started` and ended as `snapshot` says."""
        self.idle(started)
        if self._start is None:
            totals = self._last.totals if self._last else Totals()
            self._start = Snapshot(started, totals, 0, 0, 0.0)
        self._last = snapshot
        if snapshot.time - self._start.time >= self.interval:
            self._log(self._start, snapshot)
            self._start = snapshot

    def idle(self, now: float) -> None:
        """The engine has had no work since its last step: once that is an interval ago, the
        open window ends at that step."""
        last, start = self._last, self._start
        if last is None or start is None or now - last.time <= self.interval:
            return
        if last.time > start.time:
            self._log(start, last)
        self._start = None

    def _log(self, start: Snapshot, end: Snapshot) -> None:
        seconds = end.time - start.time
        queries = end.totals.prefix_queries - start.totals.prefix_queries
        hits = end.totals.prefix_hits - start.totals.prefix_hits
        logger.info(
            "%s: prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, "
            "running %d reqs, waiting %d reqs, KV cache usage %.1f%%, prefix cache hit rate %.1f%%",
            self.model_name,
            (end.totals.prompt_tokens - start.totals.prompt_tokens) / seconds,
            (end.totals.generation_tokens - start.totals.generation_tokens) / seconds,
            end.running,
            end.waiting,
            100 * end.kv_usage,
            100 * hits / queries if queries else 0.0,
        )

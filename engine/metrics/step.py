"""What an engine step reports, and the loggers it is reported to.

Each step builds one `StepStats` and hands the same object to every logger on the engine's list
(the `get_stats()` figures, the Prometheus metrics, the periodic stats line): the step loop
counts each thing once, and a logger takes what it needs from it. A logger must not keep the
object's lists beyond its `record` call: they belong to that step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from pagedbatch.engine.core.request import Request


@dataclass
class StepStats:
    """One engine step: what it did (counts of this step alone) and the engine it left behind."""

    began: float  # monotonic seconds, when the step began
    ended: float  # monotonic seconds, when its outputs were built
    num_seqs: int  # sequences run through the model
    num_tokens: int  # tokens run through the model, recomputation included
    busy_seconds: float  # from the model run to the last token processed; 0 when nothing ran
    prompt_tokens: int = 0  # prompt tokens of the requests whose first token came this step
    generation_tokens: int = 0
    # Seconds since each token's previous, by its request's priority.
    token_gaps: dict[int, list[float]] = field(default_factory=dict)
    preemptions: int = 0
    # Lower-priority tokens a step sized for realtime requests left to later steps (see
    # SchedulerOutput.deferred_tokens); such a step is a shortened one.
    deferred_tokens: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found
    media_encoded: int = 0  # images and clips the step gave the encoder
    encoder_cache_hits: int = 0  # items whose embeddings the encoder cache held
    finished: list[Request] = field(default_factory=list)  # completions retired this step
    # The engine at the end of the step.
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


class StatLogger(ABC):
    """Takes every step's stats; `idle` tells it that the engine has no work (no step runs)."""

    @abstractmethod
    def record(self, stats: StepStats) -> None: ...

    def idle(self, now: float) -> None:  # noqa: B027 - a default, not a method to fill in
        """Called by a loop that waits for work; most loggers have nothing to do then."""

"""The engine's Prometheus metrics, named as vLLM names them with our prefix (`vllm:` becomes
`pagedbatch:`), so a vLLM dashboard ports by swapping the prefix. All are labelled by model name.

The counters and histograms are process-wide, in prometheus_client's default registry: every
engine of a process feeds the series of its model, so tests that build many engines never
register a metric twice. Gauges (running, waiting, KV-cache usage) are read from the live engines
when Prometheus scrapes, so the step loop pays nothing for them and an engine that is gone stops
counting.

Per step an engine adds a handful of counter increments and two histogram updates; per finished
request, six observations; per generated token, nothing: the inter-token gaps of a step (in its
`StepStats`) go into their histogram together, in one numpy call.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pagedbatch.engine.core.kv_cache_manager import KVCacheManager
from pagedbatch.engine.core.request import Request
from pagedbatch.engine.core.scheduler import Scheduler
from pagedbatch.engine.metrics.step import StatLogger, StepStats

PREFIX = "pagedbatch:"
LABELS = ["model_name"]

# Seconds, from a fast GPU's milliseconds to a saturated CPU's minutes.
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_GAP_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class _Series:
    counts: np.ndarray  # observations per bucket, not cumulative
    total: float = 0.0


class StepHistogram(Collector):
    """A histogram labelled by model (and `labels` beyond it) that takes a step's observations at
    once: one numpy call per step instead of a Python call per token. prometheus_client's
    Histogram has no such bulk update."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: tuple[float, ...],
        labels: tuple[str, ...] = (),
    ):
        self.name = name
        self.documentation = documentation
        self.labels = [*LABELS, *labels]
        self.bounds = np.array(buckets)
        self._le = [floatToGoString(b) for b in buckets] + ["+Inf"]
        self._series: dict[tuple[str, ...], _Series] = {}
        self._lock = threading.Lock()

    def observe_many(self, model_name: str, values: list[float], *labels: str) -> None:
        """`values` into the series of `model_name` and the values of the further `labels`."""
        array = np.array(values)
        # Bucket i holds the values in (bounds[i-1], bounds[i]]; the last, those above all.
        counts = np.bincount(
            np.searchsorted(self.bounds, array, side="left"), minlength=len(self._le)
        )
        key = (model_name, *labels)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Series(np.zeros(len(self._le), np.int64))
            series.counts += counts
            series.total += float(array.sum())

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        with self._lock:
            readings = {k: (s.counts.cumsum().tolist(), s.total) for k, s in self._series.items()}
        for key, (cumulative, total) in sorted(readings.items()):
            family.add_metric(list(key), list(zip(self._le, cumulative, strict=True)), total)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labels)


PROMPT_TOKENS = Counter(
    f"{PREFIX}prompt_tokens", "Prompt tokens of requests that produced a first token.", LABELS
)
GENERATION_TOKENS = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", LABELS)
PREFIX_CACHE_QUERIES = Counter(
    f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", LABELS
)
PREFIX_CACHE_HITS = Counter(
    f"{PREFIX}prefix_cache_hits", "Prompt tokens found in the prefix cache.", LABELS
)
MEDIA_ENCODED = Counter(
    f"{PREFIX}encoder_inputs", "Images and audio clips run through an encoder.", LABELS
)
ENCODER_CACHE_HITS = Counter(
    f"{PREFIX}encoder_cache_hits",
    "Images and clips whose embeddings the encoder cache held when a request needed them.",
    LABELS,
)
PREEMPTIONS = Counter(
    f"{PREFIX}num_preemptions", "Requests preempted for lack of KV-cache blocks.", LABELS
)
REQUEST_SUCCESS = Counter(
    f"{PREFIX}request_success",
    "Finished requests, by finish reason (stop, length, abort, error).",
    [*LABELS, "finished_reason"],
)
TTFT = Histogram(
    f"{PREFIX}time_to_first_token_seconds",
    "From arrival to the first generated token.",
    LABELS,
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = StepHistogram(
    f"{PREFIX}inter_token_latency_seconds",
    "Between two consecutive tokens of a request.",
    _TOKEN_GAP_BUCKETS,
)
REGISTRY.register(INTER_TOKEN_LATENCY)
# Per request priority (the service's realtime requests, 0, and batch lines, 10): what steps
# sized for realtime requests are for, and what they cost the rest.
TTFT_BY_PRIORITY = Histogram(
    f"{PREFIX}time_to_first_token_by_priority_seconds",
    "From arrival to the first generated token, by request priority.",
    [*LABELS, "priority"],
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY_BY_PRIORITY = StepHistogram(
    f"{PREFIX}inter_token_latency_by_priority_seconds",
    "Between two consecutive tokens of a request, by request priority.",
    _TOKEN_GAP_BUCKETS,
    ("priority",),
)
REGISTRY.register(INTER_TOKEN_LATENCY_BY_PRIORITY)
BATCH_TOKENS_DEFERRED = Counter(
    f"{PREFIX}batch_tokens_deferred",
    "Lower-priority tokens that steps sized for realtime requests left to later steps.",
    LABELS,
)
STEPS_SHORTENED = Counter(
    f"{PREFIX}steps_shortened",
    "Steps sized for realtime requests that left lower-priority work to later steps.",
    LABELS,
)
QUEUE_TIME = Histogram(
    f"{PREFIX}request_queue_time_seconds",
    "From arrival to first being scheduled.",
    LABELS,
    buckets=_REQUEST_BUCKETS,
)
PREFILL_TIME = Histogram(
    f"{PREFIX}request_prefill_time_seconds",
    "From first being scheduled to the first token.",
    LABELS,
    buckets=_REQUEST_BUCKETS,
)
DECODE_TIME = Histogram(
    f"{PREFIX}request_decode_time_seconds",
    "From the first token to the last.",
    LABELS,
    buckets=_REQUEST_BUCKETS,
)
E2E_LATENCY = Histogram(
    f"{PREFIX}e2e_request_latency_seconds",
    "From arrival to finishing.",
    LABELS,
    buckets=_REQUEST_BUCKETS,
)
ITERATION_TOKENS = Histogram(
    f"{PREFIX}iteration_tokens_total",
    "Tokens run through the model per engine step: the batch size.",
    LABELS,
    buckets=_STEP_TOKEN_BUCKETS,
)


class EngineMetrics(StatLogger):
    """One engine's feed into the process-wide metrics: a logger on the engine's list."""

    def __init__(self, model_name: str, kv: KVCacheManager, scheduler: Scheduler):
        self.model_name = model_name
        self.kv = kv
        self.scheduler = scheduler
        self._prompt_tokens = PROMPT_TOKENS.labels(model_name)
        self._generation_tokens = GENERATION_TOKENS.labels(model_name)
        self._queries = PREFIX_CACHE_QUERIES.labels(model_name)
        self._hits = PREFIX_CACHE_HITS.labels(model_name)
        self._preemptions = PREEMPTIONS.labels(model_name)
        self._media_encoded = MEDIA_ENCODED.labels(model_name)
        self._encoder_cache_hits = ENCODER_CACHE_HITS.labels(model_name)
        self._deferred = BATCH_TOKENS_DEFERRED.labels(model_name)
        self._shortened = STEPS_SHORTENED.labels(model_name)
        self._ttft = TTFT.labels(model_name)
        self._queue_time = QUEUE_TIME.labels(model_name)
        self._prefill_time = PREFILL_TIME.labels(model_name)
        self._decode_time = DECODE_TIME.labels(model_name)
        self._e2e = E2E_LATENCY.labels(model_name)
        self._iteration_tokens = ITERATION_TOKENS.labels(model_name)
        LIVE_ENGINES.add(self)

    def record(self, stats: StepStats) -> None:
        if stats.num_tokens:
            self._iteration_tokens.observe(stats.num_tokens)
        # Each increment takes a lock; most steps move only some of the counters.
        counters = (
            (self._prompt_tokens, stats.prompt_tokens),
            (self._generation_tokens, stats.generation_tokens),
            (self._queries, stats.prefix_queries),
            (self._hits, stats.prefix_hits),
            (self._preemptions, stats.preemptions),
            (self._media_encoded, stats.media_encoded),
            (self._encoder_cache_hits, stats.encoder_cache_hits),
            (self._deferred, stats.deferred_tokens),
            (self._shortened, 1 if stats.deferred_tokens else 0),
        )
        for counter, amount in counters:
            if amount:
                counter.inc(amount)
        for priority, gaps in stats.token_gaps.items():
            INTER_TOKEN_LATENCY.observe_many(self.model_name, gaps)
            INTER_TOKEN_LATENCY_BY_PRIORITY.observe_many(self.model_name, gaps, str(priority))
        for request in stats.finished:
            self._record_finished(request)

    def _record_finished(self, request: Request) -> None:
        REQUEST_SUCCESS.labels(self.model_name, request.finish_reason).inc()
        arrival = request.arrival_time
        scheduled, first, last = (
            request.first_scheduled_time,
            request.first_token_time,
            request.last_token_time,
        )
        if scheduled is not None:
            self._queue_time.observe(scheduled - arrival)
            if first is not None:
                self._prefill_time.observe(first - scheduled)
        if first is not None:
            self._ttft.observe(first - arrival)
            TTFT_BY_PRIORITY.labels(self.model_name, str(request.priority)).observe(first - arrival)
            if last is not None:
                self._decode_time.observe(last - first)
        if request.finished_time is not None:
            self._e2e.observe(request.finished_time - arrival)

    # What the gauges read, from the scraping thread, while the engine thread may be mid-step:
    # the length of a list or dict is read atomically, so a reading is at worst a step old.
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_blocks(self) -> tuple[int, int]:
        """(used, total) KV-cache blocks."""
        pool = self.kv.pool
        return pool.num_blocks - pool.num_free_blocks, pool.num_blocks


class _LiveEngineGauges(Collector):
    """Running and waiting requests and KV-cache usage of each model's live engines, summed."""

    def __init__(self) -> None:
        self._engines: weakref.WeakSet[EngineMetrics] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, engine: EngineMetrics) -> None:
        with self._lock:
            self._engines.add(engine)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            engines = list(self._engines)
        running: dict[str, int] = defaultdict(int)
        waiting: dict[str, int] = defaultdict(int)
        blocks: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for engine in engines:
            running[engine.model_name] += engine.num_running
            waiting[engine.model_name] += engine.num_waiting
            used, total = engine.kv_blocks
            blocks[engine.model_name][0] += used
            blocks[engine.model_name][1] += total
        families = (
            (f"{PREFIX}num_requests_running", "Requests in the running batch.", running),
            (
                f"{PREFIX}num_requests_waiting",
                "Requests waiting, preempted ones included.",
                waiting,
            ),
            (
                f"{PREFIX}kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use, 0 to 1.",
                # An encoder-only model keeps no KV cache: nothing of it is in use.
                {model: used / total if total else 0.0 for model, (used, total) in blocks.items()},
            ),
        )
        for name, documentation, values in families:
            family = GaugeMetricFamily(name, documentation, labels=LABELS)
            for model, value in sorted(values.items()):
                family.add_metric([model], value)
            yield family

    def describe(self) -> Iterator[Metric]:
        # Without it the registry would collect at registration, to learn the names.
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            yield GaugeMetricFamily(f"{PREFIX}{name}", "", labels=LABELS)


LIVE_ENGINES = _LiveEngineGauges()
REGISTRY.register(LIVE_ENGINES)

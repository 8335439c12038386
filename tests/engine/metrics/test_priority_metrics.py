"""The metrics of steps sized for realtime requests: TTFT and inter-token latency by priority,
the batch tokens such steps deferred and how many steps they shortened, in Prometheus and in
`get_stats()` alike."""

from __future__ import annotations

import uuid
from pathlib import Path

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedbatch.engine import LLM, SamplingParams

REALTIME, BATCH = 0, 10


def scrape(model: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("model_name", None) == model:
                samples[sample.name, tuple(sorted(labels.items()))] = sample.value
    return samples


def test_priority_latencies_and_shortened_steps_are_counted(tiny_llama: Path):
    model_name = f"metrics-{uuid.uuid4().hex[:8]}"
    # One batch token a step while realtime requests run: every other batch decode is deferred.
    llm = LLM(
        tiny_llama, num_kv_blocks=128, served_model_name=model_name, low_priority_token_budget=1
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"b{i}", [10 + i, 11, 12], params, priority=BATCH)
    engine.step()
    engine.add_request("rt", [20, 21, 22], params, priority=REALTIME)
    while engine.has_unfinished_requests():
        engine.step()

    m = scrape(model_name)
    for priority, requests in ((REALTIME, 1), (BATCH, 3)):
        label = (("priority", str(priority)),)
        assert m["pagedbatch:time_to_first_token_by_priority_seconds_count", label] == requests
        gaps = m["pagedbatch:inter_token_latency_by_priority_seconds_count", label]
        assert gaps == requests * 3  # one between each two of a request's four tokens
    stats = engine.get_stats()
    deferred, shortened = stats["batch_tokens_deferred"], stats["steps_shortened"]
    assert deferred >= shortened > 0
    assert m["pagedbatch:batch_tokens_deferred_total", ()] == deferred
    assert m["pagedbatch:steps_shortened_total", ()] == shortened

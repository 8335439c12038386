"""The engine's Prometheus metrics move by exactly what a known workload does, under vLLM's names
with our prefix."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vision_oracle import chat_text, image

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.metrics.prometheus import StepHistogram

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

BLOCK = 4
PREFIX = list(range(100, 116))  # four full blocks
PROMPT_A = PREFIX + [200, 201, 202, 203]  # 20 tokens
PROMPT_B = PREFIX + [300, 301, 302]  # 19 tokens


def scrape(model: str) -> Samples:
    """Every sample of `model` in the default registry's exposition, keyed by name and the other
    labels."""
    text = generate_latest(REGISTRY).decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("model_name", None) == model:
                samples[sample.name, tuple(sorted(labels.items()))] = sample.value
    return samples


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def model_name() -> str:
    # A name of its own: the metrics are process-wide, and other tests' engines feed them too.
    return f"metrics-{uuid.uuid4().hex[:8]}"


def test_counters_and_histograms_move_by_what_the_requests_did(tiny_llama: Path, model_name: str):
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=BLOCK, served_model_name=model_name)
    llm.generate([PROMPT_A], greedy(5))
    # After A: B finds A's four prefix blocks cached; its fifth block differs.
    llm.generate([PROMPT_B], greedy(3))

    m = scrape(model_name)
    assert m["pagedbatch:prompt_tokens_total", ()] == 20 + 19
    assert m["pagedbatch:generation_tokens_total", ()] == 5 + 3
    assert m["pagedbatch:request_success_total", (("finished_reason", "length"),)] == 2
    assert m["pagedbatch:prefix_cache_queries_total", ()] == 20 + 19
    assert m["pagedbatch:prefix_cache_hits_total", ()] == len(PREFIX)
    assert m["pagedbatch:num_preemptions_total", ()] == 0
    # One gap between each two consecutive tokens of a request.
    assert m["pagedbatch:inter_token_latency_seconds_count", ()] == 4 + 2
    for name in (
        "time_to_first_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "e2e_request_latency_seconds",
    ):
        assert m[f"pagedbatch:{name}_count", ()] == 2, name
    # A: a 20-token prefill, then 4 decode steps. B: the 3 uncached prompt tokens, then 2.
    assert m["pagedbatch:iteration_tokens_total_count", ()] == 5 + 3
    assert m["pagedbatch:iteration_tokens_total_sum", ()] == (20 + 4) + (3 + 2)
    # Idle again: nothing runs, waits or holds a block.
    assert m["pagedbatch:num_requests_running", ()] == 0
    assert m["pagedbatch:num_requests_waiting", ()] == 0
    assert m["pagedbatch:kv_cache_usage_perc", ()] == 0
    assert llm.get_stats()["prefix_cache_hits"] == len(PREFIX)


def test_preemptions_and_aborts_are_counted(tiny_llama: Path, model_name: str):
    prompts = [[10 + i] * 40 for i in range(8)]
    # 14 blocks of 16 tokens cannot hold 8 requests of 80 tokens at once.
    llm = LLM(tiny_llama, num_kv_blocks=14, max_num_seqs=8, served_model_name=model_name)
    llm.generate(prompts, greedy(40))
    preemptions = llm.get_stats()["preemptions"]
    assert preemptions > 0

    request_id = llm.engine.add_request(None, [5, 6, 7], greedy(100))
    llm.engine.step()
    llm.abort(request_id)
    llm.engine.step()

    m = scrape(model_name)
    assert m["pagedbatch:num_preemptions_total", ()] == preemptions
    assert m["pagedbatch:request_success_total", (("finished_reason", "length"),)] == 8
    assert m["pagedbatch:request_success_total", (("finished_reason", "abort"),)] == 1


def test_gauges_show_the_work_in_the_engine(tiny_llama: Path, model_name: str):
    llm = LLM(
        tiny_llama, num_kv_blocks=10, block_size=BLOCK, max_num_seqs=2, served_model_name=model_name
    )
    for prompt in ([1] * 8, [2] * 8, [3] * 8):
        llm.engine.add_request(None, prompt, greedy(4))
    llm.engine.step()  # two seats: two prefill, one waits

    m = scrape(model_name)
    assert m["pagedbatch:num_requests_running", ()] == 2
    assert m["pagedbatch:num_requests_waiting", ()] == 1
    # Each running request's 8 prompt tokens fill two blocks: 4 of the 10 are in use.
    assert m["pagedbatch:kv_cache_usage_perc", ()] == pytest.approx(4 / 10)


def test_an_embedding_model_without_a_kv_cache_shows_none_in_use(make_checkpoint, model_name: str):
    llm = LLM(make_checkpoint("bert"), served_model_name=model_name)
    llm.embed(["the sea"])

    m = scrape(model_name)  # every model's gauges are collected at once: this one must not fail
    assert m["pagedbatch:kv_cache_usage_perc", ()] == 0.0
    assert m["pagedbatch:num_requests_running", ()] == 0


def test_a_step_histogram_buckets_as_prometheus_client_does():
    buckets = (0.01, 0.1, 1.0)
    values = [0.0, 0.01, 0.010001, 0.05, 0.1, 1.0, 3.0, 250.0]
    ours = StepHistogram("ours_seconds", "ours", buckets)
    ours.observe_many("m", values[:3])
    ours.observe_many("m", values[3:])
    theirs = CollectorRegistry()
    reference = Histogram("ours_seconds", "ours", ["model_name"], buckets=buckets, registry=theirs)
    for v in values:
        reference.labels("m").observe(v)

    def samples(text: str) -> set[tuple[str, tuple, float]]:
        return {
            (s.name, tuple(sorted(s.labels.items())), s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if not s.name.endswith("_created")
        }

    mine = CollectorRegistry()
    mine.register(ours)
    assert samples(generate_latest(mine).decode()) == samples(generate_latest(theirs).decode())


def test_media_encoded_and_encoder_cache_hits_are_counted(make_checkpoint, model_name: str):
    model_dir = make_checkpoint("llava")
    llm = LLM(model_dir, served_model_name=model_name)
    picture = image(5)
    for system in ("One.", "Two, so that the image is no prefix hit."):
        text = chat_text(model_dir, "Hi", 1, system)
        llm.generate({"prompt": text, "images": [picture]}, greedy(2))
    m = scrape(model_name)
    assert m["pagedbatch:encoder_inputs_total", ()] == 1
    assert m["pagedbatch:encoder_cache_hits_total", ()] == 1

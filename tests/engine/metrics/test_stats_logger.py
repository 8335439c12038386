"""The periodic stats line: throughput over its window, idle time left out, and only when the
engine is asked for it."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from pagedbatch.engine import LLM, AsyncLLM, SamplingParams
from pagedbatch.engine.metrics.stats_line import Snapshot, StatsLogger, Totals


def at(time: float, *, prompt=0, generation=0, queries=0, hits=0, running=0, waiting=0, kv=0.0):
    return Snapshot(time, Totals(prompt, generation, queries, hits), running, waiting, kv)


def stats_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The stats logger's lines (an engine may warn of other things meanwhile)."""
    return [
        r.getMessage() for r in caplog.records if r.name == "pagedbatch.engine.metrics.stats_line"
    ]


def test_the_stats_line_reports_rates_over_its_window(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="pagedbatch.engine.metrics.stats_line")
    log = StatsLogger("tiny", interval=2.0)
    log.step(0.0, at(0.5, prompt=100, generation=10))
    assert not caplog.messages  # 0.5 s into a 2 s window
    end = at(2.0, prompt=100, generation=50, queries=100, hits=25, running=3, waiting=1, kv=0.25)
    log.step(1.5, end)
    assert caplog.messages == [
        "tiny: prompt throughput 50.0 tokens/s, generation throughput 25.0 tokens/s, "
        "running 3 reqs, waiting 1 reqs, KV cache usage 25.0%, prefix cache hit rate 25.0%"
    ]


def test_idle_time_does_not_dilute_the_rates(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="pagedbatch.engine.metrics.stats_line")
    log = StatsLogger("tiny", interval=2.0)
    log.step(0.0, at(1.0, generation=10, running=1))
    # Ten idle seconds, then work again: the first window closes at its last step, 1 s long.
    log.step(11.0, at(11.5, generation=20, running=1))
    assert caplog.messages[-1].startswith(
        "tiny: prompt throughput 0.0 tokens/s, generation throughput 10.0 tokens/s, running 1"
    )
    # The next window starts where work resumed, from the totals the engine had then.
    log.step(12.0, at(13.0, generation=40))
    assert len(caplog.messages) == 2
    assert "generation throughput 15.0 tokens/s" in caplog.messages[-1]


def test_an_engine_logs_stats_lines_only_when_asked(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="pagedbatch.engine.metrics.stats_line")
    model_name = "stats-line"
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    LLM(tiny_llama, num_kv_blocks=16, served_model_name=model_name).generate([[1, 2]], greedy)
    assert not stats_lines(caplog)
    llm = LLM(
        tiny_llama,
        num_kv_blocks=16,
        served_model_name=model_name,
        stats_log_interval_seconds=1e-9,  # every step
    )
    llm.generate([[1, 2]], greedy)
    assert len(stats_lines(caplog)) == llm.get_stats()["steps"]
    assert all(line.startswith(f"{model_name}: prompt throughput") for line in stats_lines(caplog))


def test_a_burst_is_logged_once_the_engine_has_been_idle_for_an_interval(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.INFO, logger="pagedbatch.engine.metrics.stats_line")
    log = StatsLogger("tiny", interval=2.0)
    log.step(0.0, at(0.5, generation=20))
    log.idle(2.0)  # idle 1.5 s: the window may still grow
    assert not caplog.messages
    log.idle(3.0)
    assert len(caplog.messages) == 1
    assert "generation throughput 40.0 tokens/s" in caplog.messages[0]
    log.idle(10.0)  # nothing new to report
    assert len(caplog.messages) == 1


def test_the_async_engine_logs_a_short_burst_soon_after_it_ends(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="pagedbatch.engine.metrics.stats_line")
    llm = AsyncLLM(tiny_llama, num_kv_blocks=16, stats_log_interval_seconds=0.2)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def burst() -> None:
        async for _ in llm.generate([1, 2], params):
            pass

    try:
        asyncio.run(burst())
        deadline = time.monotonic() + 5
        while not stats_lines(caplog) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        llm.shutdown()
    assert stats_lines(caplog) and "generation throughput" in stats_lines(caplog)[0]

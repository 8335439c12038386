"""The offline batch runner (`pagedbatch run-batch`): a line that breaks in an unexpected way is
that line's error response, and the run goes on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_batch_runner import UNSCREENED

from pagedbatch.engine import AsyncLLM
from pagedbatch.protocol.batch_lines import MAX_ERROR_TEXT, BatchOutputLine
from pagedbatch.workers.batches.runner import BatchRunner


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(tiny_llama, max_num_seqs=4, num_kv_blocks=128)
    yield llm
    llm.shutdown()


def line(engine: AsyncLLM, custom_id: str, **body: object) -> str:
    body = {
        "model": engine.engine.model_name,
        "messages": [{"role": "user", "content": "Hi?"}],
        "max_tokens": 2,
        **body,
    }
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def test_a_line_that_breaks_preparation_fails_alone(engine):
    lines = [
        line(engine, "huge-bias-key", logit_bias={"-100000000000000000000000": 1}),
        line(engine, "ok"),
    ]
    written: list[BatchOutputLine] = []
    progress = BatchRunner(engine, UNSCREENED, max_in_flight=4).run(lines, written.append)
    results = {w.custom_id: w for w in written}
    assert results["ok"].response.status_code == 200
    failed = results["huge-bias-key"].response
    assert failed.status_code in (400, 500)
    assert set(failed.body["error"]) == {"message", "type", "param", "code"}
    assert (progress.lines_done, progress.lines_failed) == (2, 1)


def test_error_lines_quote_a_bounded_part_of_the_input(engine):
    written: list[BatchOutputLine] = []
    BatchRunner(engine, UNSCREENED, max_in_flight=4).run(
        [line(engine, "x", **{"y" * 50_000: 1})], written.append
    )
    error = written[0].response.body["error"]
    assert error["code"] == "unknown_parameter"
    assert len(error["message"]) < MAX_ERROR_TEXT + 40 and len(error["param"]) < MAX_ERROR_TEXT + 40

"""Engine settings in deployments: `pagedbatch serve` and `pagedbatch worker` run their engine
with the engine settings given as flags or PAGEDBATCH_ variables, `/v1/engine/stats` reports the
settings in force, and a request beyond `max_model_len` is a 400 naming the limit at both doors
(realtime and batch) and through the distributed API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
from fastapi.testclient import TestClient
from servers import free_port, wait_for_batch, wait_for_health

from pagedbatch.cli import build_parser, settings_from_args
from pagedbatch.service import api_only, engine_host_of, open_store, start_engine
from pagedbatch.workers.context import WorkerContext

GIVEN = {"max_num_seqs": 4, "max_model_len": 512, "kv_cache_memory_gib": 0.1, "dtype": "float32"}
FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in GIVEN.items()]
LIMIT = "maximum context length is 512 tokens"
TOO_LONG = [5] * 512  # with the one token to generate, 513: one over
LONGEST = [5] * 511


def completion(prompt: list[int]) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 1}


def read_lines(client: openai.OpenAI, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def assert_in_force(stats: dict[str, Any]) -> None:
    (engine,) = stats["engines"]
    settings = engine["settings"]
    assert {name: settings[name] for name in GIVEN} == GIVEN
    # What the engine resolved is reported too, and what it was not given is its default.
    assert settings["served_model_name"] == "tiny"
    assert settings["num_kv_blocks"] > 0
    assert settings["block_size"] == 16


def assert_refused_over_the_limit(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and LIMIT in error["message"]


def test_serve_runs_with_the_engine_flags_it_is_given(tmp_path: Path, tiny_llama: Path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDBATCH_")}
    command = ["serve", "--model", str(tiny_llama), "--served-model-name", "tiny"]
    command += ["--data-dir", str(tmp_path / "data"), "--port", str(port), *FLAGS]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagedbatch.cli", *command],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, process, log)
        with httpx.Client(base_url=url, timeout=60) as http:
            assert_in_force(http.get("/v1/engine/stats").json())
            assert_refused_over_the_limit(http.post("/v1/completions", json=completion(TOO_LONG)))
            assert http.post("/v1/completions", json=completion(LONGEST)).status_code == 200
    finally:
        process.terminate()
        process.wait(30)


def test_variables_set_the_embedded_engine_and_its_limit_holds_at_both_doors(
    serve_batches, monkeypatch
):
    for name, value in GIVEN.items():
        monkeypatch.setenv(f"PAGEDBATCH_{name.upper()}", str(value))
    server = serve_batches()
    with server.http() as http:
        assert_in_force(http.get("/v1/engine/stats").json())
        assert_refused_over_the_limit(http.post("/v1/completions", json=completion(TOO_LONG)))
    client = server.client()
    lines = [
        {"custom_id": name, "method": "POST", "url": "/v1/completions", "body": completion(prompt)}
        for name, prompt in (("too-long", TOO_LONG), ("longest", LONGEST))
    ]
    text = "\n".join(json.dumps(line) for line in lines).encode()
    batch_file = client.files.create(file=("in.jsonl", text), purpose="batch")
    batch = client.batches.create(
        input_file_id=batch_file.id, endpoint="/v1/completions", completion_window="24h"
    )
    batch = wait_for_batch(client, batch.id, lambda b: b.status == "completed")
    (failed,) = read_lines(client, batch.error_file_id)
    assert failed["custom_id"] == "too-long"
    assert failed["response"]["status_code"] == 400
    error = failed["response"]["body"]["error"]
    assert error["code"] == "context_length_exceeded" and LIMIT in error["message"]
    (done,) = read_lines(client, batch.output_file_id)
    assert (done["custom_id"], done["response"]["status_code"]) == ("longest", 200)


def test_a_worker_runs_with_its_engine_flags_and_the_api_reports_them(
    tmp_path: Path, tiny_llama: Path, redis_url: str
):
    args = build_parser().parse_args(
        ["worker", "--broker-url", redis_url, "--data-dir", str(tmp_path / "data")]
        + ["--model", str(tiny_llama), "--served-model-name", "tiny", *FLAGS]
        + ["--engine-heartbeat-seconds", "0.2"]
    )
    settings = settings_from_args(args)
    # What `pagedbatch worker` assembles, but Celery's loop: its engine and engine host.
    engine = start_engine(settings)
    try:
        session_factory, blobs = open_store(settings)
        host = engine_host_of(WorkerContext(settings, session_factory, blobs, None, engine))
        host.start()
        try:
            api = TestClient(api_only(settings), base_url="http://127.0.0.1")
            deadline = time.monotonic() + 10
            while not (stats := api.get("/v1/engine/stats").json())["engines"]:
                assert time.monotonic() < deadline, "the worker's engine host never registered"
                time.sleep(0.05)
            assert_in_force(stats)
            assert_refused_over_the_limit(api.post("/v1/completions", json=completion(TOO_LONG)))
        finally:
            host.stop()
    finally:
        engine.shutdown()

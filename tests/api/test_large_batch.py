"""A batch file at OpenAI's limits (50,000 lines, about 200 MB) is uploaded and validated by the
embedded service with flat memory: it is streamed, never held whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
from servers import free_port, wait_for_batch, wait_for_health

MiB = 1 << 20
LINES = 50_000
TARGET_BYTES = 190 * MiB  # just under the 200 MB limit


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def write_batch_file(path: Path, lines: int = LINES) -> int:
    # Words, not one run of a letter: about 600 tokens a line, inside the tiny model's context,
    # so that validation (which tokenizes each line) stages every line rather than refusing it.
    filler = ("hello world " * 400)[: TARGET_BYTES // LINES - 200]
    with path.open("w") as out:
        for i in range(lines):
            line = {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "tiny", "prompt": filler, "max_tokens": 1},
            }
            out.write(json.dumps(line) + "\n")
    return path.stat().st_size


def test_a_50000_line_200_mb_batch_is_taken_with_flat_memory(tmp_path, tiny_llama):
    port = free_port()
    size = write_batch_file(tmp_path / "big.jsonl")
    assert 180 * MiB < size < 200 * 10**6
    env = {
        **os.environ,
        "PAGEDBATCH_DATA_DIR": str(tmp_path / "data"),
        "PAGEDBATCH_MODEL": str(tiny_llama),
        "PAGEDBATCH_SERVED_MODEL_NAME": "tiny",
        "PAGEDBATCH_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    env = {
        k: v for k, v in env.items() if not k.startswith(("PAGEDBATCH_S3", "PAGEDBATCH_DATABASE"))
    }
    log_path = tmp_path / "server.log"
    log = log_path.open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedbatch.cli", "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, server, log_path)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
        # The baseline is a server that has run two shards of such lines at once, as the big
        # batch starts to before it is cancelled: the running (threads with allocator arenas of
        # their own, the engine full of 600-token prompts) is the engine's footprint, not the
        # file's. With a warm batch of one small shard the growth measured 25 to 85 MiB.
        write_batch_file(tmp_path / "warm.jsonl", lines=600)  # over two shards of 256 (defaults)
        with (tmp_path / "warm.jsonl").open("rb") as f:
            warm = client.files.create(file=("warm.jsonl", f), purpose="batch")
        batch = client.batches.create(
            input_file_id=warm.id, endpoint="/v1/completions", completion_window="24h"
        )
        ended = ("completed", "failed", "expired", "cancelled")
        batch = wait_for_batch(client, batch.id, lambda b: b.status in ended, timeout=120)
        assert batch.status == "completed", batch.errors
        baseline = peak_rss(server.pid)

        with (tmp_path / "big.jsonl").open("rb") as f:
            uploaded = client.files.create(file=("big.jsonl", f), purpose="batch")
        assert uploaded.bytes == size
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 300
        while batch.status == "validating":
            assert time.monotonic() < deadline, "validation took too long"
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "in_progress", batch.errors
        assert batch.request_counts.total == LINES
        client.batches.cancel(batch.id)
        grown = peak_rss(server.pid) - baseline
        # Measured: 13 to 16 MiB over four runs, whatever the file's size: a fraction of the
        # 186 MiB file, never the file.
        assert grown < 80 * MiB, (
            f"the server grew by {grown / MiB:.0f} MiB for a {size / MiB:.0f} MiB file"
        )
    finally:
        server.terminate()
        server.wait(30)

"""The service's two doors on one engine: `pagedbatch serve` (embedded: SQLite, local files, an
in-process queue) on `--device`, one realtime chat, then one batch of `--lines` completions.

    python scripts/gpu_check/doors.py --device cuda --dtype bfloat16 --work /tmp/doors

The model is the `--size` make-model llama checkpoint, built here. Plain HTTP (httpx) rather than
the openai SDK, which the device image lacks. Prints one JSON line; exits 1 when a door fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from harness import (
    BATCH_ENDED,
    Request,
    completion_lines,
    free_port,
    healthy,
    print_report,
    start_process,
    stop_process,
    tail,
    wait_until,
)

from pagedbatch.make_model import make_model

MODEL_NAME = "gpu-check"
START_SECONDS = 180.0  # model load, and on a GPU the kernels' first compilation
BATCH_SECONDS = 180.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--size", default="small", help="make-model size")
    p.add_argument("--lines", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--no-cuda-graphs", action="store_true", help="decode steps run eagerly")
    return p.parse_args()


def chat(client: httpx.Client, max_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hello from the GPU check"}],
        "max_tokens": max_tokens,
    }
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    answer = response.json()
    return {
        "ok": bool(answer["choices"][0]["message"]["content"])
        and answer["usage"]["completion_tokens"] > 0,
        "completion_tokens": answer["usage"]["completion_tokens"],
        "seconds": round(time.perf_counter() - started, 2),
    }


def batch(client: httpx.Client, lines: int, max_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    requests = [Request([10 + i, 200 + i, 3000 + i], max_tokens) for i in range(lines)]
    upload = client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("gpu-check.jsonl", completion_lines(requests, MODEL_NAME))},
    )
    upload.raise_for_status()
    created = client.post(
        "/v1/batches",
        json={
            "input_file_id": upload.json()["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        },
    )
    created.raise_for_status()
    batch_id = created.json()["id"]
    deadline = time.monotonic() + BATCH_SECONDS
    while (state := client.get(f"/v1/batches/{batch_id}").json())["status"] not in BATCH_ENDED:
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id} still {state['status']} after {BATCH_SECONDS} s")
        time.sleep(0.2)
    figures: dict[str, Any] = {"status": state["status"], "request_counts": state["request_counts"]}
    if state.get("output_file_id"):
        output = client.get(f"/v1/files/{state['output_file_id']}/content").text.splitlines()
        figures["output_lines"] = len(output)
    figures["ok"] = state["status"] == "completed" and figures.get("output_lines") == lines
    figures["seconds"] = round(time.perf_counter() - started, 2)
    return figures


def main() -> None:
    args = parse_args()
    model = make_model(args.work / "model", arch="llama", size=args.size)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.work / "serve.log"
    argv = [sys.executable, "-P", "-m", "pagedbatch.cli", "serve", "--port", str(port)]
    argv += ["--model", str(model), "--served-model-name", MODEL_NAME]
    argv += ["--device", args.device, "--dtype", args.dtype, "--kv-cache-memory-gib", "1"]
    argv += ["--data-dir", str(args.work / "data")]
    if args.no_cuda_graphs:
        argv.append("--no-cuda-graphs")
    started = time.perf_counter()
    server = start_process(argv, dict(os.environ), log)
    results: dict[str, Any] = {"device": args.device, "dtype": args.dtype}
    try:
        wait_until(lambda: healthy(url), server, "the server", log, START_SECONDS)
        results["start_seconds"] = round(time.perf_counter() - started, 1)
        with httpx.Client(base_url=url, timeout=120) as client:
            results["chat"] = chat(client, args.max_tokens)
            results["batch"] = batch(client, args.lines, args.max_tokens)
    finally:
        stop_process(server)
        # The server's log goes to this step's log (stderr), for the device run's $OUT.
        print(tail(log, 200), file=sys.stderr)
    results["ok"] = results["chat"]["ok"] and results["batch"]["ok"]
    print_report(results)
    sys.exit(0 if results["ok"] else 1)


if __name__ == "__main__":
    main()

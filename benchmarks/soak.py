"""Soak: a mixed load on the embedded server for a long while, watching its memory, files, threads.

    python benchmarks/soak.py                 # tiny llama, 20 minutes
    python benchmarks/soak.py --minutes 2     # a check that it runs

`pagedbatch serve` (the embedded service: API, in-process task queue and engine) runs as a child
process on 127.0.0.1 with a fresh data directory, so what is sampled is the server alone. Until
the time is up, on threads of this process:
- streaming chat clients, each request streamed to its end, except that every
  --disconnect-every-th one hangs up after its first chunks, on purpose (the server must abort
  its engine requests and free what they held);
- non-streaming clients, alternating chat and completions requests;
- a batch loop: upload a file of --batch-lines lines, create a batch, poll it until it ends,
  read its output, then delete both files (a client that cleans up, as a long-lived one must).

Every --sample-interval seconds the server's RSS, open file descriptors and thread count are read
(psutil if installed, else /proc). The figures, one JSON line on stdout: the run's duration,
requests done (by kind), batches done, errors by kind, and for RSS, fds and threads the value
after warm-up (the first sample past --warmup-fraction of the run), the final value, the max
and the least-squares slope per minute over the samples after warm-up. A leak shows as a
slope that does not flatten as the run grows longer; compare a 20-minute run with a shorter one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import (
    BATCH_ENDED,
    ensure_model,
    free_port,
    healthy,
    load_avg,
    log,
    run_and_report,
    start_process,
    tail,
    wait_until,
)

SERVED_NAME = "soak"
KV_CACHE_GIB = 0.125
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 120.0  # one request; a realtime request of the tiny model takes well under 1 s
BATCH_TIMEOUT_S = 600.0  # one batch, from creation to its end
JOIN_TIMEOUT_S = 180.0  # for the clients to finish what they started when the time is up
PROMPTS = [
    "Tell me a story about a lighthouse keeper.",
    "List three prime numbers and explain why.",
    "What is the capital of France?",
    "Write a haiku about memory leaks.",
    "Summarise the plot of a film you like.",
]


# ---------------------------------------------------------------------------------------------
# Sampling the server process


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the load started
    rss_mib: float
    fds: int
    threads: int


def sample_process(pid: int, t: float) -> Sample:
    try:
        import psutil
    except ImportError:
        return _sample_proc(pid, t)
    process = psutil.Process(pid)
    rss_mib = round(process.memory_info().rss / 2**20, 1)
    return Sample(round(t, 1), rss_mib, process.num_fds(), process.num_threads())


def _sample_proc(pid: int, t: float) -> Sample:
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    rss_kib = int(status["VmRSS"].split()[0])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Sample(round(t, 1), round(rss_kib / 1024, 1), fds, int(status["Threads"]))


def slope_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 60


def figures(samples: list[Sample], warmup_s: float) -> dict[str, Any]:
    after = [s for s in samples if s.t >= warmup_s] or samples[-1:]
    out: dict[str, Any] = {}
    for name in ("rss_mib", "fds", "threads"):
        values = [getattr(s, name) for s in samples]
        slope = slope_per_minute([(s.t, getattr(s, name)) for s in after])
        out[name] = {
            "after_warmup": getattr(after[0], name),
            "final": values[-1],
            "max": max(values),
            "slope_per_min": None if slope is None else round(slope, 3),
        }
    return out


# ---------------------------------------------------------------------------------------------
# The load


@dataclass
class Tally:
    """What the clients did, shared by their threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    batch_lines: int = 0

    def count(self, kind: str) -> None:
        with self.lock:
            self.requests[kind] += 1

    def error(self, kind: str, exc_or_text: BaseException | str) -> None:
        text = (
            exc_or_text
            if isinstance(exc_or_text, str)
            else f"{type(exc_or_text).__name__}: {str(exc_or_text)[:80]}"
        )
        with self.lock:
            self.errors[f"{kind}: {text}"] += 1


@dataclass
class Load:
    url: str
    deadline: float
    tally: Tally
    args: argparse.Namespace

    def running(self) -> bool:
        return time.monotonic() < self.deadline


def client(url: str) -> Any:
    import httpx

    return httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)


def chat_body(rng: random.Random, stream: bool) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_completion_tokens": rng.randint(8, 64),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "stream": stream,
    }


def completion_body(rng: random.Random) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "prompt": rng.choice(PROMPTS),
        "max_tokens": rng.randint(8, 64),
        "temperature": rng.choice([0, 0.7]),
    }


def streaming_client(load: Load, index: int) -> None:
    """Streams chat requests; every --disconnect-every-th hangs up after its first chunks."""
    rng = random.Random(f"stream/{index}")
    with client(load.url) as http:
        sent = 0
        while load.running():
            sent += 1
            hang_up = sent % load.args.disconnect_every == 0
            kind = "stream_disconnected" if hang_up else "stream"
            try:
                with http.stream("POST", "/v1/chat/completions", json=chat_body(rng, True)) as r:
                    if r.status_code != 200:
                        r.read()
                        load.tally.error(kind, f"status {r.status_code}")
                        continue
                    events = 0
                    ending: str | None = "stream ended without [DONE]"
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        events += 1
                        if line == "data: [DONE]":
                            ending = None
                        elif '"error"' in line[:20]:
                            ending = f"error event: {line[6:120]}"
                            break
                        if hang_up and events >= 2:
                            ending = None
                            break  # leaving the block closes the connection mid-stream
                    if ending is not None:
                        load.tally.error(kind, ending)
                        continue
                load.tally.count(kind)
            except Exception as exc:  # noqa: BLE001 - counted and reported, the soak goes on
                load.tally.error(kind, exc)
                time.sleep(1)


def plain_client(load: Load, index: int) -> None:
    rng = random.Random(f"plain/{index}")
    with client(load.url) as http:
        chat = index % 2 == 0
        while load.running():
            chat = not chat
            kind, path, body = (
                ("chat", "/v1/chat/completions", chat_body(rng, False))
                if chat
                else ("completion", "/v1/completions", completion_body(rng))
            )
            try:
                response = http.post(path, json=body)
                if response.status_code != 200:
                    load.tally.error(kind, f"status {response.status_code}")
                    continue
                if not response.json().get("choices"):
                    load.tally.error(kind, "no choices")
                    continue
                load.tally.count(kind)
            except Exception as exc:  # noqa: BLE001
                load.tally.error(kind, exc)
                time.sleep(1)


def batch_loop(load: Load) -> None:
    rng = random.Random("batch")
    with client(load.url) as http:
        while load.running():
            try:
                run_one_batch(http, rng, load)
            except Exception as exc:  # noqa: BLE001
                load.tally.error("batch", exc)
                time.sleep(1)


def run_one_batch(http: Any, rng: random.Random, load: Load) -> None:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**chat_body(rng, False), "stream": False},
        }
        for i in range(load.args.batch_lines)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    response = http.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}
    )
    response.raise_for_status()
    input_id = response.json()["id"]
    body = {
        "input_file_id": input_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    response = http.post("/v1/batches", json=body)
    response.raise_for_status()
    batch = response.json()
    deadline = time.monotonic() + BATCH_TIMEOUT_S
    # Once the time is up a batch still gets its chance to end: the run waits for it.
    while batch["status"] not in BATCH_ENDED and time.monotonic() < deadline:
        time.sleep(0.5)
        response = http.get(f"/v1/batches/{batch['id']}")
        response.raise_for_status()
        batch = response.json()
    counts = batch.get("request_counts") or {}
    if batch["status"] != "completed" or counts.get("completed") != len(lines):
        load.tally.error("batch", f"{batch['status']} with counts {counts}")
    else:
        output = http.get(f"/v1/files/{batch['output_file_id']}/content")
        output.raise_for_status()
        if len(output.content.splitlines()) != len(lines):
            load.tally.error("batch", "output lines missing")
        else:
            with load.tally.lock:
                load.tally.batches += 1
                load.tally.batch_lines += len(lines)
    for file_id in (input_id, batch.get("output_file_id"), batch.get("error_file_id")):
        if file_id:
            http.delete(f"/v1/files/{file_id}").raise_for_status()


def sampler(pid: int, started: float, stop: threading.Event, interval: float) -> list[Sample]:
    samples: list[Sample] = []

    def run() -> None:
        while True:
            with contextlib.suppress(OSError):  # the process went away: the run reports it
                samples.append(sample_process(pid, time.monotonic() - started))
            if stop.wait(interval):
                return

    threading.Thread(target=run, name="sampler", daemon=True).start()
    return samples


# ---------------------------------------------------------------------------------------------
# The run


def start_server(stack: contextlib.ExitStack, tmp: Path, model_dir: Path) -> tuple[str, int, Path]:
    port = free_port()
    pagedbatch = Path(sys.executable).with_name("pagedbatch")
    argv = [
        str(pagedbatch),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-dir",
        str(tmp / "data"),
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        # A KV cache the load cycles through within the warm-up: its pages are committed as
        # blocks are first used (the free queue hands out the least recently used), so a larger
        # one would look like growth for as long as it takes to touch it all.
        "--kv-cache-memory-gib",
        str(KV_CACHE_GIB),
    ]
    # Only the flags above configure it, whatever this shell exports.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDBATCH_")}
    log_path = tmp / "server.log"
    process = start_process(argv, env, log_path, tmp, stack)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: healthy(url), process, "the server", log_path, START_TIMEOUT_S)
    return url, process.pid, log_path


def run(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    model_dir = ensure_model(args.model, args.size)
    tmp = Path(tempfile.mkdtemp(prefix="pagedbatch-soak-"))
    stack.callback(shutil.rmtree, tmp, ignore_errors=True)
    url, pid, log_path = start_server(stack, tmp, model_dir)
    log(f"server {pid} at {url}; load for {args.minutes} min")

    duration = args.minutes * 60
    started = time.monotonic()
    load = Load(url, started + duration, Tally(), args)
    stop_sampling = threading.Event()
    samples = sampler(pid, started, stop_sampling, args.sample_interval)
    workers: list[tuple[str, Callable[[], None]]] = [
        *(
            (f"stream{i}", lambda i=i: streaming_client(load, i))
            for i in range(args.stream_clients)
        ),
        *((f"plain{i}", lambda i=i: plain_client(load, i)) for i in range(args.plain_clients)),
        ("batches", lambda: batch_loop(load)),
    ]
    threads = [threading.Thread(target=fn, name=name, daemon=True) for name, fn in workers]
    for thread in threads:
        thread.start()
    while load.running():
        time.sleep(min(30.0, max(0.1, load.deadline - time.monotonic())))
        with load.tally.lock:
            log(
                f"{time.monotonic() - started:.0f} s: {sum(load.tally.requests.values())} "
                f"requests, {load.tally.batches} batches, {sum(load.tally.errors.values())} "
                f"errors; {samples[-1] if samples else 'no sample yet'}"
            )
    join_deadline = time.monotonic() + JOIN_TIMEOUT_S
    for thread in threads:
        thread.join(max(0.0, join_deadline - time.monotonic()))
    stuck = [thread.name for thread in threads if thread.is_alive()]
    elapsed = time.monotonic() - started
    stop_sampling.set()
    with contextlib.suppress(OSError):
        samples.append(sample_process(pid, elapsed))  # the final value, after the load
    import httpx

    try:
        health = httpx.get(f"{url}/health", timeout=10).status_code
    except httpx.TransportError as exc:
        health = f"{type(exc).__name__}"
    server_log = log_path.read_text(errors="replace")
    if samples:
        log(f"last samples: {samples[-3:]}")
    if stuck or health != 200:
        log(f"server log tail:\n{tail(log_path)}")
    tally = load.tally
    return {
        "benchmark": "soak",
        "model": str(model_dir),
        "duration_s": round(elapsed, 1),
        "load_window_s": duration,
        "clients": {
            "streaming": args.stream_clients,
            "disconnect_every": args.disconnect_every,
            "plain": args.plain_clients,
            "batch_lines": args.batch_lines,
        },
        "requests_done": sum(tally.requests.values()),
        "requests_by_kind": dict(tally.requests),
        "batches_done": tally.batches,
        "batch_lines_done": tally.batch_lines,
        "errors": sum(tally.errors.values()),
        "errors_by_kind": dict(tally.errors.most_common(20)),
        "clients_stuck_at_end": stuck,
        "health_after": health,
        "server_tracebacks": server_log.count("Traceback (most recent call last)"),
        "samples": len(samples),
        "warmup_s": round(duration * args.warmup_fraction, 1),
        **figures(samples, duration * args.warmup_fraction),
        "load_avg_end": load_avg(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=20.0, help="how long the load runs")
    p.add_argument("--model", help="checkpoint directory (default: built in ~/.cache/pagedbatch)")
    p.add_argument("--size", choices=["tiny", "small", "medium"], default="tiny")
    p.add_argument("--stream-clients", type=int, default=3)
    p.add_argument(
        "--disconnect-every",
        type=int,
        default=3,
        help="each streaming client hangs up mid-stream on every n-th of its requests",
    )
    p.add_argument("--plain-clients", type=int, default=2)
    p.add_argument("--batch-lines", type=int, default=32)
    p.add_argument("--sample-interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.2,
        help="the share of the run before the 'after warm-up' figures and slopes start",
    )
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.sample_interval <= 0 or not 0 <= args.warmup_fraction < 1:
        p.error("need --minutes > 0, --sample-interval > 0 and 0 <= --warmup-fraction < 1")
    if min(args.stream_clients, args.plain_clients) < 0 or args.batch_lines < 1:
        p.error("client counts must be at least 0 and --batch-lines at least 1")
    if args.disconnect_every < 1:
        p.error("--disconnect-every must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_and_report(run, args)


if __name__ == "__main__":
    main()

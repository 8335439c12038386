"""Chaos: distributed batches running while Redis, PostgreSQL and S3 restart in turn.

    python benchmarks/chaos.py                          # 3 batches of 60 lines, 3 s outages
    python benchmarks/chaos.py --batches 1 --lines 20   # a quick check that it runs

The distributed deployment on services of its own, on free ports (a PostgreSQL cluster, a
redis-server and a SeaweedFS server, which this script stops and starts; the machine's shared
servers are never touched): the API (`pagedbatch serve`) and --workers `pagedbatch worker`
processes, on the tiny benchmark model. Once every batch is running, each service in turn goes
down for --down-seconds and comes back on the same port and data (Redis and S3 are killed, as a
crash; PostgreSQL shuts down fast, as a restart; Redis comes back empty), each time after the
batches moved since the one before. All along a poller asks the API for a batch and the model
list every --poll-interval seconds.

One JSON line on stdout: whether every batch completed, lines lost (in no output or error file)
and duplicated (in them more than once), failed lines, the API's answers by status (503 is what
the API documents while a store is down; any other 5xx counts in `http_5xx_beyond_503`), polls
that got no answer, for each restart how long the API and the batches took to move again, and
whether each worker is still the process it started as, with no unrecoverable error logged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import (
    BATCH_ENDED,
    PostgresCluster,
    Process,
    RedisServer,
    SeaweedFS,
    ensure_model,
    free_port,
    healthy,
    log,
    run_and_report,
    start_process,
    wait_until,
)

SERVED_NAME = "chaos"
START_TIMEOUT_S = 120.0
PROGRESS_TIMEOUT_S = 300.0  # for the batches to move after a restart
REQUEST_TIMEOUT_S = 30.0
WORKER_DEATH = "Unrecoverable error"  # what Celery logs as a worker's consumer dies


@dataclass
class Poller:
    """Asks the API for a batch (in turn) and the model list, noting each answer's status."""

    url: str
    batch_ids: list[str]
    interval: float
    answers: list[tuple[float, int | str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        import httpx

        paths = [f"/v1/batches/{batch_id}" for batch_id in self.batch_ids] + ["/v1/models"]
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S) as http:
            for turn in range(10**9):
                if self.stop.wait(self.interval):
                    return
                try:
                    status: int | str = http.get(paths[turn % len(paths)]).status_code
                except httpx.TransportError as exc:
                    status = type(exc).__name__
                self.answers.append((time.monotonic(), status))

    def back_after(self, moment: float, timeout: float) -> float | None:
        """Seconds from `moment` to the first 200 after it; None if none came in `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            later = [at for at, status in list(self.answers) if at > moment and status == 200]
            if later:
                return round(later[0] - moment, 2)
            time.sleep(0.05)
        return None


@dataclass
class Service:
    name: str
    down: Callable[[], None]
    up: Callable[[], None]


def batch_file(batch: int, lines: int, max_tokens: int) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"b{batch}-r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": SERVED_NAME,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Question {i} of batch {batch}"}],
                },
            }
        ).encode()
        + b"\n"
        for i in range(lines)
    )


def retrying(call: Callable[[], Any], timeout: float) -> Any:
    """`call()` again until it answers (the API may be between a store's going and coming)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def batches(http: Any, batch_ids: list[str]) -> list[dict[str, Any]]:
    def get(batch_id: str) -> dict[str, Any]:
        response = http.get(f"/v1/batches/{batch_id}")
        response.raise_for_status()
        return response.json()

    return [
        retrying(lambda batch_id=batch_id: get(batch_id), PROGRESS_TIMEOUT_S)
        for batch_id in batch_ids
    ]


def lines_done(http: Any, batch_ids: list[str]) -> int:
    return sum(
        b["request_counts"]["completed"] + b["request_counts"]["failed"]
        for b in batches(http, batch_ids)
    )


def wait_for_progress(http: Any, batch_ids: list[str], beyond: int, timeout: float) -> int | None:
    """Lines done once the batches moved past `beyond`; None if they all ended or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = lines_done(http, batch_ids)
        if done > beyond:
            return done
        if all(b["status"] in BATCH_ENDED for b in batches(http, batch_ids)):
            return None
        time.sleep(0.2)
    return None


def written_lines(http: Any, batch: dict[str, Any]) -> Counter[str]:
    """How many times each custom_id is in the batch's output and error files."""
    seen: Counter[str] = Counter()
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            response = retrying(lambda key=key: http.get(f"/v1/files/{batch[key]}/content"), 60)
            response.raise_for_status()
            seen.update(json.loads(line)["custom_id"] for line in response.text.splitlines())
    return seen


def start_deployment(
    args: argparse.Namespace, stack: contextlib.ExitStack, tmp: Path, env: dict[str, str]
) -> tuple[str, list[Process]]:
    url = f"http://127.0.0.1:{env['PAGEDBATCH_PORT']}"
    argv = [sys.executable, "-m", "pagedbatch.cli"]
    api = start_process([*argv, "serve"], env, tmp / "api.log", tmp, stack)
    wait_until(lambda: healthy(url), api, "the API", tmp / "api.log", START_TIMEOUT_S)
    workers = [
        start_process([*argv, "worker"], env, tmp / f"worker-{i}.log", tmp, stack)
        for i in range(args.workers)
    ]
    return url, workers


def run(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    import httpx

    model = ensure_model(args.model, args.size)
    tmp = Path(tempfile.mkdtemp(prefix="pagedbatch-chaos-"))
    stack.callback(shutil.rmtree, tmp, ignore_errors=True)
    log(f"services and logs in {tmp}")

    postgres = PostgresCluster()
    stack.callback(postgres.remove)
    postgres.start()
    redis_server = RedisServer(tmp / "redis.log")
    redis_server.start()
    stack.callback(redis_server.kill)
    s3 = SeaweedFS(tmp / "seaweedfs")
    s3.start()
    stack.callback(s3.stop)

    env = {
        **os.environ,
        **s3.server.env(),
        "PAGEDBATCH_DATABASE_URL": postgres.url,
        "PAGEDBATCH_BROKER_URL": redis_server.url,
        "PAGEDBATCH_S3_BUCKET": f"chaos-{uuid.uuid4().hex[:12]}",
        "PAGEDBATCH_DATA_DIR": str(tmp / "data"),
        "PAGEDBATCH_MODEL": str(model),
        "PAGEDBATCH_SERVED_MODEL_NAME": SERVED_NAME,
        "PAGEDBATCH_PORT": str(free_port()),
        "PAGEDBATCH_SHARD_SIZE": str(args.shard_size),
        "PAGEDBATCH_WORKER_HEARTBEAT_SECONDS": "1",
        "PAGEDBATCH_UPKEEP_INTERVAL_SECONDS": "1",
        "PAGEDBATCH_REAPER_INTERVAL_SECONDS": "2",
        "PAGEDBATCH_WORKER_METRICS_PORT": "0",
        "OMP_NUM_THREADS": "1",
    }
    url, workers = start_deployment(args, stack, tmp, env)
    http = stack.enter_context(httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S))

    started = time.monotonic()
    batch_ids = []
    for index in range(args.batches):
        data = batch_file(index, args.lines, args.max_tokens)
        file_id = http.post(
            "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"}
        ).json()["id"]
        created = http.post(
            "/v1/batches",
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        batch_ids.append(created.json()["id"])
    log(f"{args.batches} batches of {args.lines} lines created; waiting for the first lines")
    done = wait_for_progress(http, batch_ids, 0, START_TIMEOUT_S)
    if done is None:
        raise RuntimeError("the batches did not start")

    poller = Poller(url, batch_ids, args.poll_interval)
    polling = threading.Thread(target=poller.run, name="poller", daemon=True)
    polling.start()
    stack.callback(polling.join)
    stack.callback(poller.stop.set)

    services = [
        Service("redis", redis_server.kill, redis_server.start),
        Service("postgres", postgres.stop, postgres.start),
        Service("s3", s3.kill, s3.start),
    ]
    total = args.batches * args.lines
    restarts: dict[str, dict[str, Any]] = {}
    for service in services:
        moved = wait_for_progress(http, batch_ids, done, PROGRESS_TIMEOUT_S)
        if moved is None or moved >= total:
            log(f"the batches ended before {service.name} went down: make them longer")
            restarts[service.name] = {"mid_batch": False}
            continue
        log(f"{service.name}: down for {args.down_seconds} s at {moved} of {total} lines")
        service.down()
        time.sleep(args.down_seconds)
        service.up()
        back = time.monotonic()
        at_back = lines_done(http, batch_ids)
        done = wait_for_progress(http, batch_ids, at_back, PROGRESS_TIMEOUT_S) or at_back
        moving = time.monotonic()
        restarts[service.name] = {
            "mid_batch": True,
            "lines_done_down": moved,
            "lines_done_up": at_back,
            "api_back_s": poller.back_after(back, PROGRESS_TIMEOUT_S),
            # From coming back to the next line done (None: none was left to do).
            "moving_again_s": round(moving - back, 2) if done > at_back else None,
        }
        log(f"{service.name}: back; {restarts[service.name]}")

    deadline = time.monotonic() + args.timeout
    while not all(b["status"] in BATCH_ENDED for b in batches(http, batch_ids)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    wall_s = time.monotonic() - started
    poller.stop.set()
    polling.join()

    ended = batches(http, batch_ids)
    lost = duplicated = failed = 0
    for index, batch in enumerate(ended):
        seen = written_lines(http, batch)
        expected = {f"b{index}-r{i}" for i in range(args.lines)}
        lost += len(expected - seen.keys())
        duplicated += sum(count - 1 for count in seen.values())
        failed += batch["request_counts"]["failed"]
    statuses = Counter(str(status) for _, status in poller.answers)
    worker_logs = [
        (tmp / f"worker-{i}.log").read_text(errors="replace") for i in range(len(workers))
    ]
    return {
        "batches": args.batches,
        "lines_per_batch": args.lines,
        "max_tokens": args.max_tokens,
        "down_seconds": args.down_seconds,
        "batches_completed": sum(b["status"] == "completed" for b in ended),
        "batch_statuses": dict(Counter(b["status"] for b in ended)),
        "lines_lost": lost,
        "lines_duplicated": duplicated,
        "lines_failed": failed,
        "restarts": restarts,
        "polls": len(poller.answers),
        "http_statuses": dict(statuses),
        "http_5xx_beyond_503": sum(
            n for status, n in statuses.items() if status.startswith("5") and status != "503"
        ),
        "polls_unanswered": sum(n for status, n in statuses.items() if not status.isdigit()),
        "workers_alive": sum(worker.poll() is None for worker in workers),
        "workers": len(workers),
        "worker_deaths_logged": sum(text.count(WORKER_DEATH) for text in worker_logs),
        "wall_s": round(wall_s, 1),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="checkpoint directory (default: built in ~/.cache/pagedbatch)")
    p.add_argument("--size", choices=["tiny", "small", "medium"], default="tiny")
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--lines", type=int, default=60, help="lines per batch")
    p.add_argument("--max-tokens", type=int, default=300, help="tokens each line generates")
    p.add_argument("--shard-size", type=int, default=10)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--down-seconds", type=float, default=3.0, help="how long each outage lasts")
    p.add_argument("--poll-interval", type=float, default=0.25, help="seconds between polls")
    p.add_argument("--timeout", type=float, default=900.0, help="for the batches to end")
    args = p.parse_args(argv)
    if min(args.batches, args.lines, args.max_tokens, args.shard_size, args.workers) < 1:
        p.error("--batches, --lines, --max-tokens, --shard-size and --workers must be at least 1")
    if args.down_seconds < 0 or args.poll_interval <= 0:
        p.error("need --down-seconds >= 0 and --poll-interval > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    run_and_report(run, parse_args(argv))


if __name__ == "__main__":
    main()

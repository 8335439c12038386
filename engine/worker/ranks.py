"""Tensor-parallel ranks 1..N-1: processes that rank 0 (the engine's process) starts, feeds and
supervises.

Each rank is a spawned process holding its model shard and KV cache. Every step, rank 0 sends it
the step's `StepInput` through a pipe, then all ranks run the step together, meeting in the
collectives; the scheduler and the sampler run on rank 0 only.

A rank that dies must fail the engine, never hang it. A watcher thread on rank 0 waits on the
ranks' process sentinels: when one ends unasked, it records why, breaks off NCCL collectives and
kills the other ranks, whose closed sockets fail any gloo collective rank 0 is in. From then on
every step raises `TensorParallelError`. A rank whose rank 0 has gone finds its pipe closed, or
its collectives failing, and exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch
import torch.multiprocessing as mp

from pagedbatch.engine.config import EngineArgs, ModelConfig
from pagedbatch.engine.worker import distributed
from pagedbatch.engine.worker.model_runner import ModelRunner, StepInput, rank_device

logger = logging.getLogger(__name__)

# How long a failed step waits for the watcher to name a rank that died: the usual reason a
# collective fails, and a better error than the collective's own.
DEATH_NOTICE_SECONDS = 2.0
# How long ranks get to exit after being told to, before they are killed.
EXIT_SECONDS = 5.0
READY = "ready"


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the engine cannot run any more steps."""


def start_runner(cfg: ModelConfig, args: EngineArgs) -> ModelRunner:
    """Rank 0's model runner; with tensor_parallel_size > 1, the other ranks started and ready."""
    size = args.tensor_parallel_size
    if size == 1:
        return ModelRunner(cfg, args)
    cfg.check_tensor_parallel(size)
    device = rank_device(args.device, 0, size)
    threads = 1
    if device.type == "cpu":
        # The ranks share the machine's cores.
        threads = max(1, torch.get_num_threads() // size)
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(device)  # NCCL runs rank 0's collectives on its current device
    ranks = RankProcesses(cfg, args, threads)
    try:
        tp = ranks.connect(device)
        runner = ModelRunner(cfg, args, tp)
        ranks.wait_ready()
    except BaseException as e:
        error = ranks.failure()
        ranks.shutdown()
        if error is None:
            raise
        raise error from e
    runner.ranks = ranks
    # An engine dropped without shutdown still stops its ranks.
    weakref.finalize(runner, ranks.shutdown)
    return runner


class RankProcesses:
    """Ranks 1..N-1 of one engine, as seen from rank 0."""

    def __init__(self, cfg: ModelConfig, args: EngineArgs, threads: int):
        self.size = args.tensor_parallel_size
        self._store = distributed.host_store(self.size)
        self._tp: distributed.TensorParallel | None = None
        self._lock = threading.Lock()
        self._closing = False
        self._dead: tuple[int, int] | None = None  # (rank, exit code) of the first rank that died
        self._error: TensorParallelError | None = None
        context = mp.get_context("spawn")
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        for rank in range(1, self.size):
            ours, theirs = context.Pipe()
            proc = context.Process(
                target=_rank_main,
                args=(rank, self.size, self._store.port, cfg, args, threads, theirs),
                name=f"pagedbatch-rank-{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        self._stop_read, self._stop_write = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name="pagedbatch-ranks", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        """The process ids of ranks 1..N-1, in rank order."""
        return [proc.pid for proc in self._procs]

    # Start-up ----------------------------------------------------------------------------------

    def connect(self, device: torch.device) -> distributed.TensorParallel:
        """Rank 0 joins the group. It waits for every rank to join, so a rank that dies first
        (say, while importing) must end the wait: the joining runs beside a watch on the ranks."""
        joined: list[distributed.TensorParallel | BaseException] = []

        def join() -> None:
            try:
                joined.append(distributed.connect(self._store, 0, self.size, device))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                joined.append(e)

        joiner = threading.Thread(target=join, name="pagedbatch-rank-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(timeout=0.1)
            if self._dead is not None:
                raise self._failure()
        if isinstance(joined[0], BaseException):
            raise joined[0]
        self._tp = joined[0]
        return self._tp

    def wait_ready(self) -> None:
        """Waits until every rank has loaded its shard and allocated its KV cache."""
        pending = dict(zip(self._conns, range(1, self.size), strict=True))
        while pending:
            if self._dead is not None:
                raise self._failure()
            for conn in wait(list(pending), timeout=0.1):
                try:
                    message = conn.recv()
                except EOFError:  # it died: the watcher has it
                    del pending[conn]
                    continue
                if message != READY:
                    raise self._fail(f"tensor-parallel rank {pending[conn]} failed: {message}")
                del pending[conn]
        if self._dead is not None:
            raise self._failure()

    # Steps -------------------------------------------------------------------------------------

    def run(self, step: StepInput, local: Callable[[StepInput], torch.Tensor]) -> torch.Tensor:
        """Hands the step to every rank and runs rank 0's part; any failure is fatal."""
        error = self.failure()
        if error is not None:
            self.shutdown()
            raise error
        try:
            for conn in self._conns:
                conn.send(step)
            logits = local(step)
            if logits.is_cuda:
                # After an NCCL abort the results are garbage: learn of it before using them.
                torch.cuda.synchronize(logits.device)
        except BaseException as e:
            # The ranks are no longer in step: whatever broke this one, none can follow it.
            if not isinstance(e, Exception):  # an interrupt: stop the ranks, re-raise as is
                self._fail("a tensor-parallel step was interrupted")
                self.shutdown()
                raise
            # A rank's death is the likeliest reason; give the watcher a moment to see it.
            self._watcher.join(timeout=DEATH_NOTICE_SECONDS)
            error = self._failure() if self._dead is not None else None
            if error is None:
                error = self._fail(f"a tensor-parallel step failed on rank 0: {e}")
            self.shutdown()
            raise error from e
        if self._dead is not None:
            error = self._failure()
            self.shutdown()
            raise error
        return logits

    # Failure and shutdown ----------------------------------------------------------------------

    def failure(self) -> TensorParallelError | None:
        """What failed the ranks, if anything has."""
        return self._failure() if self._dead is not None else self._error

    def _watch(self) -> None:
        ranks = {proc.sentinel: rank for rank, proc in enumerate(self._procs, 1)}
        ready = wait([*ranks, self._stop_read])
        if self._stop_read in ready:
            return
        rank = ranks[ready[0]]
        proc = self._procs[rank - 1]
        proc.join(timeout=1.0)  # the sentinel may fire a moment before the exit code is there
        with self._lock:
            if self._closing:
                return
            self._dead = (rank, proc.exitcode)
        logger.error("tensor-parallel rank %d died (exit code %s)", *self._dead)
        if self._tp is not None:
            self._tp.abort()
        self._kill()

    def _failure(self) -> TensorParallelError:
        """The error for the rank that died, with its last words if it sent any."""
        if self._error is None:
            rank, code = self._dead
            detail = f"exit code {code}"
            if code is not None and code < 0:
                detail += f", {signal.Signals(-code).name}"
            conn = self._conns[rank - 1]
            try:
                if conn.poll():
                    detail += f": {conn.recv()}"
            except (EOFError, OSError):
                pass
            self._error = TensorParallelError(
                f"tensor-parallel rank {rank} died ({detail}); the engine has stopped"
            )
        return self._error

    def _fail(self, message: str) -> TensorParallelError:
        if self._error is None:
            self._error = TensorParallelError(message + "; the engine has stopped")
        return self._error

    def _kill(self) -> None:
        for proc in self._procs:
            proc.kill()

    def shutdown(self) -> None:
        """Stops every rank: asks them to exit, kills those that do not. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        os.write(self._stop_write, b"x")
        self._watcher.join()
        for conn in self._conns:
            with contextlib.suppress(OSError):  # that rank has gone already
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=EXIT_SECONDS)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        os.close(self._stop_read)
        os.close(self._stop_write)


def _rank_main(
    rank: int,
    size: int,
    store_port: int,
    cfg: ModelConfig,
    args: EngineArgs,
    threads: int,
    conn: Connection,
) -> None:
    """A rank's process: join the group, load the shard, then run every step rank 0 sends."""
    torch.set_num_threads(threads)
    try:
        device = rank_device(args.device, rank, size)
        store = distributed.join_store(store_port, size)
        runner = ModelRunner(cfg, args, distributed.connect(store, rank, size, device))
        conn.send(READY)
        while (step := conn.recv()) is not None:
            runner.run(step)
    except EOFError:  # rank 0 has gone
        return
    except BaseException as e:
        with contextlib.suppress(OSError):
            conn.send(f"{type(e).__name__}: {e}")
        raise

"""Threads that each run torch on one core, for a CPU step split into independent shards.

An encoder's step is many short sequences that need nothing of each other: split into as many
shards as the process has torch threads, each shard runs whole on a thread of its own with one
OpenMP thread, side by side. Its matmuls are large enough to reach a core's peak alone, and no
op waits at a barrier for the other cores: with small ops (an encoder's attention is a few
dozen per layer) on a machine whose cores other processes share, those barriers made a step
several times slower than the same work on one core.

The pool's threads set their own OpenMP thread count (torch keeps it per thread) and leave the
process's as it was, for the caller and for any thread started later.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


class ShardThreads:
    def __init__(self, count: int):
        self.count = count
        self._pool: ThreadPoolExecutor | None = None
        if count < 2:
            return
        threads = torch.get_num_threads()
        started = threading.Barrier(count)

        def single_threaded() -> None:
            torch.get_num_threads()  # torch's per-thread set-up first, or it would undo this
            torch.set_num_threads(1)

        self._pool = ThreadPoolExecutor(
            count, thread_name_prefix="pagedbatch-shard", initializer=single_threaded
        )
        # Every thread started (each task waits for the others) before the count is restored.
        list(self._pool.map(lambda _: started.wait(), range(count)))
        torch.set_num_threads(threads)

    def map(self, fn: Callable[[T], R], shards: Sequence[T]) -> list[R]:
        """`fn` of each shard, in order: on the pool's threads, under inference mode (which is
        per thread); inline, as the caller runs, without a pool."""
        if self._pool is None or len(shards) < 2:
            return [fn(shard) for shard in shards]

        def run(shard: T) -> R:
            with torch.inference_mode():
                return fn(shard)

        return list(self._pool.map(run, shards))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

"""The tensor-parallel rank group: who this process is among the ranks, and its collectives.

Each engine builds its own group (a gloo or NCCL backend over a TCP store that rank 0 hosts) rather
than torch.distributed's process-wide default group, so one process can hold several engines, one
after another or at once. With one rank there is no group and every collective is the identity:
the same model code runs either way.

Models learn their rank while they are built: `building_for(tp)` sets it for the layers'
constructors (`current()`), so a model class keeps the one-argument constructor plugins use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    # The c10d base class of ProcessGroupGloo and ProcessGroupNCCL.
    from torch._C._distributed_c10d import Backend

# How long a rank waits for the others in one collective (and to join the group). A rank that
# dies is noticed at once through its closed sockets and its process sentinel; this bounds the
# wait on one that is alive but stuck. It must outlast loading a large checkpoint, since the first
# collective waits for every rank to finish loading.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# Every rank runs on this machine: rank 0 starts the others.
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in the group and its collectives. `backend` is None with one rank."""

    rank: int = 0
    size: int = 1
    backend: Backend | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; every rank gets the same bits."""
        if self.size > 1:
            self._backend.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's x along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._backend.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def min(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values (`device`: this rank's)."""
        if self.size == 1:
            return value
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        t = torch.tensor([value], device=device)
        self._backend.allreduce([t], options).wait()
        return int(t.item())

    def abort(self) -> None:
        """Breaks off NCCL collectives in flight, so that a rank waiting on a dead one returns.
        (Gloo needs nothing: a dead rank's closed sockets fail the collectives waiting on it.)"""
        if self.backend is not None and self.backend.name() == "nccl":
            self.backend.abort()

    @property
    def _backend(self) -> Backend:
        if self.backend is None:
            raise RuntimeError(f"rank {self.rank} of {self.size} has no group to communicate in")
        return self.backend


SINGLE = TensorParallel()

_current: ContextVar[TensorParallel] = ContextVar("tensor_parallel", default=SINGLE)


def current() -> TensorParallel:
    """The rank a model under construction is built for."""
    return _current.get()


@contextlib.contextmanager
def building_for(tp: TensorParallel) -> Iterator[None]:
    token = _current.set(tp)
    try:
        yield
    finally:
        _current.reset(token)


def divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({size})")
    return total // size


def host_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous point, on a free port (its `.port`)."""
    return dist.TCPStore(
        LOOPBACK, 0, size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT
    )


def join_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)


def connect(store: dist.Store, rank: int, size: int, device: torch.device) -> TensorParallel:
    """Joins the group: NCCL between CUDA devices, gloo on CPU. Blocks until every rank has."""
    if device.type == "cuda":
        # NCCL binds a rank to the current device.
        torch.cuda.set_device(device)
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = COLLECTIVE_TIMEOUT
        backend: Backend = dist.ProcessGroupNCCL(store, rank, size, nccl_options)
    else:
        gloo = dist.ProcessGroupGloo
        gloo_options = gloo._Options()
        gloo_options._devices = [gloo.create_device(hostname=LOOPBACK)]
        gloo_options._timeout = COLLECTIVE_TIMEOUT
        backend = gloo(store, rank, size, gloo_options)
    return TensorParallel(rank, size, backend)

"""The host's memory on CPU: how much of it the KV cache may take where no setting says, and how
the C allocator keeps what a step frees.

KV budget: a quarter of the memory available when the engine starts, at most 8 GiB: enough for long
contexts on a large machine, and room left on a small one for the weights, the activations and
the other processes (an API server, a second worker). Available means the kernel's
`MemAvailable`, or less where the process's cgroup (a container's memory limit) allows less.
The cache's pages are committed only as blocks are first written, so an unused budget costs
address space, not memory.

Freed memory: a prefill step's activations are tensors of megabytes, made and dropped on every
layer. glibc's malloc serves blocks above its threshold (128 KiB, raised as large blocks are
freed, at most 32 MiB) with fresh mappings and returns memory above its trim threshold to the
kernel, so each such tensor costs a page fault per 4 KiB written. `keep_freed_memory` raises both,
once per process: a 2,048-token prefill step of the `small` model took 7% less time (its matmuls'
outputs and the model's copies no longer fault), decode steps the same. Memory freed at the top of
the heap goes back to the kernel once more than `TRIM_THRESHOLD_BYTES` of it lies there.

Kept, freed memory stays resident: a prefill step's activations (SmolLM2, 2,048 tokens: some
50 MiB at once, more touched over the layers) and the loader's transient copies would count in
the process's RSS for the rest of its life, though the decode steps after need a fraction of
them. `release_freed_memory` hands every whole free page back (glibc's `malloc_trim`, which
unlike the trim threshold reaches free chunks inside the heap too); the runner calls it once the
model is loaded and after a step of at least `RELEASE_AFTER_PROMPT_TOKENS` prompt tokens, whose
time (seconds) dwarfs the call's few milliseconds and its next step's page faults on the first
layer's activations. SmolLM2 Q4_1's 128 chat prompts (benchmarks/quantized.py's batch): peak RSS
beyond the KV cache 636 MiB before, 447 after.

Decode steps free memory too: their temporaries land in the free chunks that the load and the
prefills left (hundreds of MiB, their pages handed back), a different chunk from step to step,
so the pages they fault back in add up: that batch's RSS beyond the KV cache grew by 130 MiB over
its 257 steps, 380 to 511 MiB. `FreedMemory.after_step` therefore releases also once
`RELEASE_INTERVAL_SECONDS` have passed since it last did: peak 490 -> 391 MiB, at some 10 ms a
second of steps (1%).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CPU_KV_FRACTION = 0.25
CPU_KV_CAP_BYTES = 8 * 2**30
MEMINFO = Path("/proc/meminfo")
SELF_STATUS = Path("/proc/self/status")
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2, as a container sees its own

# glibc's mallopt parameters (malloc.h) and the values set for them
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # the largest glibc accepts
TRIM_THRESHOLD_BYTES = 256 * 2**20
TOP_PAD_BYTES = 64 * 2**20
# Prompt tokens in a step (beyond one token a sequence) after which its freed memory is released.
RELEASE_AFTER_PROMPT_TOKENS = 256
# Seconds after which the freed memory of any step is released.
RELEASE_INTERVAL_SECONDS = 1.0


def cpu_kv_budget_bytes() -> int:
    return min(CPU_KV_CAP_BYTES, int(available_bytes() * CPU_KV_FRACTION))


def available_bytes() -> int:
    """Memory this process could still use: the least of the host's and its cgroup's room."""
    room = [_mem_available()]
    limit, used = _read_int(CGROUP / "memory.max"), _read_int(CGROUP / "memory.current")
    if limit is not None and used is not None:
        room.append(max(0, limit - used))
    return min(room)


def _mem_available() -> int:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel counts in KiB
    except OSError:
        pass
    # No /proc (not Linux): free physical pages, which leaves out reclaimable caches.
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def peak_rss_mib() -> float:
    """This process's peak RSS: Linux's VmHWM, the high-water mark of its own memory map. Not
    ru_maxrss, which a process started by fork and exec inherits from its parent's RSS at the
    fork (a child of a 1.7 GiB benchmark parent reported 1.7 GiB however little it used)."""
    try:
        for line in SELF_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # in KiB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB or bytes


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None where there is none ("max", or no such file)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc's on Linux (mallopt, malloc_trim); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc's alone has both)
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def keep_freed_memory() -> bool:
    """Has glibc's malloc keep freed blocks up to 32 MiB for reuse (see the module's docstring).
    Returns whether it could: elsewhere than glibc on Linux nothing changes."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES),
    )
    applied = all(mallopt(param, value) == 1 for param, value in settings)
    if not applied:
        logger.warning("malloc refused the settings that keep freed memory for reuse")
    return applied


def release_freed_memory() -> bool:
    """Returns the whole pages of every free chunk malloc holds to the kernel (see the module's
    docstring); the chunks stay malloc's, their pages fault in again when next written. Returns
    whether it could: elsewhere than glibc on Linux nothing changes."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


class FreedMemory:
    """When a CPU engine's steps hand their freed memory back (see the module's docstring)."""

    def __init__(self) -> None:
        self.released_at = time.monotonic()

    def after_step(self, prompt_tokens: int) -> bool:
        """Releases after a step of `prompt_tokens` (beyond one token a sequence) where they are
        many or the last release is long enough ago; returns whether it did."""
        due = time.monotonic() - self.released_at >= RELEASE_INTERVAL_SECONDS
        if not (due or prompt_tokens >= RELEASE_AFTER_PROMPT_TOKENS):
            return False
        release_freed_memory()
        self.released_at = time.monotonic()
        return True

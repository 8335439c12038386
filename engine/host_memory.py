"""How much of the host's memory the KV cache may take on CPU, where no setting says.

A quarter of the memory available when the engine starts, at most 8 GiB: enough for long
contexts on a large machine, and room left on a small one for the weights, the activations and
the other processes (an API server, a second worker). Available means the kernel's
`MemAvailable`, or less where the process's cgroup (a container's memory limit) allows less.
The cache's pages are committed only as blocks are first written, so an unused budget costs
address space, not memory.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_KV_FRACTION = 0.25
CPU_KV_CAP_BYTES = 8 * 2**30
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2, as a container sees its own


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


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None where there is none ("max", or no such file)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None

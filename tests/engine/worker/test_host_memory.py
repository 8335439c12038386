"""The CPU KV cache's default budget: a quarter of the memory available, at most 8 GiB, where a
container's cgroup limit counts as less memory; and freed activations kept for reuse."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedbatch.engine import LLM
from pagedbatch.engine.worker import host_memory

GIB = 2**30


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A host with 12 GiB available and an empty cgroup directory: tests write its files."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {16 * GIB // 1024} kB\nMemAvailable: {12 * GIB // 1024} kB\n")
    monkeypatch.setattr(host_memory, "MEMINFO", meminfo)
    monkeypatch.setattr(host_memory, "CGROUP", tmp_path / "cgroup")
    (tmp_path / "cgroup").mkdir()
    return tmp_path / "cgroup"


def test_a_quarter_of_the_hosts_available_memory(host: Path):
    assert host_memory.available_bytes() == 12 * GIB
    assert host_memory.cpu_kv_budget_bytes() == 3 * GIB


def test_a_cgroup_limit_is_less_room_than_the_host(host: Path):
    (host / "memory.max").write_text(f"{4 * GIB}\n")
    (host / "memory.current").write_text(f"{1 * GIB}\n")
    assert host_memory.available_bytes() == 3 * GIB
    assert host_memory.cpu_kv_budget_bytes() == 3 * GIB // 4
    (host / "memory.max").write_text("max\n")  # no limit
    assert host_memory.available_bytes() == 12 * GIB


def test_the_budget_never_passes_its_cap(host: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(host_memory, "CPU_KV_CAP_BYTES", 2 * GIB)
    assert host_memory.cpu_kv_budget_bytes() == 2 * GIB


def test_an_engine_without_a_setting_takes_the_budget(host: Path, tiny_llama: Path):
    (host / "memory.max").write_text(f"{2 * GIB}\n")
    (host / "memory.current").write_text("0\n")
    runner = LLM(tiny_llama).engine.runner
    assert runner.num_blocks == (GIB // 2) // runner.kv_bytes_per_block


# Run in a fresh interpreter: malloc's settings are the process's.
REUSE_PROBE = """
import resource
import torch
from pagedbatch.engine.worker.host_memory import keep_freed_memory

assert keep_freed_memory()

def round_faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # A prefill step's activations: several tensors of tens of MiB alive at once, then freed.
    tensors = [torch.ones(7_500_000) for _ in range(4)]
    del tensors
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

# Pages malloc has just taken from the kernel fault once, the first time they are written.
for _ in range(4):
    round_faults()
print(sum(round_faults() for _ in range(3)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_freed_activations_are_reused_without_page_faults():
    # Without the settings, glibc hands each of these 30 MB tensors fresh pages in most runs (its
    # own threshold adapts to what was freed before, so not in all): 7,324 faults a tensor.
    probe = subprocess.run(
        [sys.executable, "-c", REUSE_PROBE], capture_output=True, text=True, check=True
    )
    assert int(probe.stdout) < 3 * 4 * 7_324 // 20


RELEASE_PROBE = """
import json
import torch
from pagedbatch.engine.worker.host_memory import keep_freed_memory, release_freed_memory

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

assert keep_freed_memory()
# A prefill's activations, each followed by a small tensor that stays: freed, they are holes
# inside the heap, which no trim threshold returns.
tensors, kept = [], []
for _ in range(4):
    tensors.append(torch.ones(7_500_000))
    kept.append(torch.ones(1000))
del tensors
freed = rss_mib()
assert release_freed_memory()
print(json.dumps([freed, rss_mib()]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_freed_activations_pages_are_released_on_demand():
    """Kept for reuse, the 4 x 30 MB freed stay resident until `release_freed_memory`, which the
    runner calls after a prefill step: then at most a tenth of them is left."""
    probe = subprocess.run(
        [sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, check=True
    )
    kept, released = json.loads(probe.stdout)
    assert kept - released >= 0.9 * 4 * 30e6 / 2**20


def test_steps_release_freed_memory_after_a_long_prompt_or_once_a_while(monkeypatch):
    freed = host_memory.FreedMemory()
    assert freed.after_step(host_memory.RELEASE_AFTER_PROMPT_TOKENS)  # a prefill's activations
    assert not freed.after_step(0)  # decode steps, just after a release
    assert not freed.after_step(host_memory.RELEASE_AFTER_PROMPT_TOKENS - 1)
    monkeypatch.setattr(host_memory, "RELEASE_INTERVAL_SECONDS", 0.05)
    time.sleep(0.06)
    assert freed.after_step(0)  # the decode steps' pages, once the interval has passed
    assert not freed.after_step(0)


# A parent of 400 MB starts a child that touches 50 MB: its own peak, then ru_maxrss's.
INHERITED_PROBE = """
import json, resource, subprocess, sys
if sys.argv[1:] == ["child"]:
    from pagedbatch.engine.worker.host_memory import peak_rss_mib
    touched = bytearray(50 * 2**20)
    print(json.dumps([peak_rss_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))
else:
    held = bytearray(400 * 2**20)
    print(subprocess.run([sys.executable, "-c", sys.argv[1], "child"], capture_output=True,
                         text=True, check=True).stdout)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and ru_maxrss are Linux's")
def test_a_processs_peak_rss_is_its_own_not_its_parents():
    """A worker started by a large parent (a benchmark's, a server's) reports its own peak: where
    ru_maxrss carries the parent's RSS over the fork, `peak_rss_mib` is under it."""
    probe = subprocess.run(
        [sys.executable, "-c", INHERITED_PROBE, INHERITED_PROBE],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    own, inherited = json.loads(probe.stdout)
    assert inherited >= 400
    assert 50 <= own < 300

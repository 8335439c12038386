"""The CPU KV cache's default budget: a quarter of the memory available, at most 8 GiB, where a
container's cgroup limit counts as less memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedbatch.engine import LLM, host_memory

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

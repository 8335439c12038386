"""scripts/gpu-check, the GPU check prepared for a lent GPU: its dry run on this CPU machine builds
the wheel folder a device call carries, checks that it installs for the device image's Python,
and runs every step (kernels, parity, doors, throughput) on tiny shapes, the Triton kernels in
Triton's interpreter. A step that breaks here would break on the GPU, where time is scarce."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "gpu_check"))

import wheels  # noqa: E402 - scripts/gpu_check, put on the path just above

from pagedbatch.engine.worker.gguf import cache_root  # noqa: E402

STEPS = {"install", "kernels", "parity", "doors", "attention", "throughput"}
# What a device call brings back from $OUT.
MAX_OUT_FILES = 8


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
    except OSError:
        return False
    return True


def test_the_carried_wheels_are_what_the_image_lacks() -> None:
    needs = wheels.missing_from_image()
    # The service's own stack, which the image has no copy of...
    assert {"fastapi", "pydantic", "pydantic-core", "sqlalchemy", "uvicorn"} <= needs.keys()
    # ...and nothing the image holds: its torch (CUDA), triton and transformers are used as is.
    assert not needs.keys() & wheels.image_packages()
    assert "torch" not in needs and "transformers" not in needs


def test_the_dry_run_passes(tmp_path: Path) -> None:
    # The wheels are kept between runs (the folder's manifest says when they are stale).
    folder = cache_root().parent / "gpu-wheels"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-check"), "--dry-run"]
        + ["--wheels", str(folder), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=500,
    )
    summary = json.loads(done.stdout.splitlines()[-1])
    error = summary["install"].get("error", "")
    if error.startswith("WheelsUnavailable") and not pypi_reachable():
        pytest.skip(f"the wheel folder needs PyPI, which cannot be reached: {error[:200]}")
    logs = {path.name: path.read_text()[-3000:] for path in (tmp_path / "out").iterdir()}
    assert done.returncode == 0 and summary["ok"], (summary, logs)
    assert summary.keys() >= STEPS
    assert 0 < summary["install"]["wheels_mib"] <= 64
    assert summary["kernels"]["tests"] > 0 and summary["doors"]["batch"]["output_lines"] == 10
    assert len(logs) <= MAX_OUT_FILES and "gpu-check.json" in logs

"""`scripts/gpu-check`: the whole GPU check in one command, and its dry run on a CPU machine.

    .venv/bin/python scripts/gpu-check --build-wheels     # here: the wheel folder the call carries
    python3 scripts/gpu-check                             # on the device machine (one H100)
    .venv/bin/python scripts/gpu-check --dry-run          # here: every step on CPU, tiny shapes

The device call carries the wheel folder (`.gpu-wheels`, see wheels.py) and runs, in the
repository root, `python3 scripts/gpu-check`. The check installs the project with `pip install
--no-deps` into a folder of its own, beside the carried wheels, on top of the image's packages
(torch, triton, transformers), and runs each step in a process of its own against that install:

1. kernels: the Triton kernel tests (tests/kernels/test_triton_*.py) against the torch
   references, on CUDA tensors, and decode steps replayed from CUDA graphs against eager ones
   (tests/engine/worker/test_decode_graphs.py);
2. parity: greedy tokens against transformers, float32 and bfloat16 (parity.py);
3. throughput: benchmarks/throughput.py (ours against transformers on the GPU, MFU against the
   measured GEMM peak) and benchmarks/attention_bandwidth.py (the decode kernel's bandwidth
   against a device-to-device copy's);
4. doors: one chat and one 10-line batch through the embedded server on the GPU (doors.py).

It prints one JSON line (the summary, also `$OUT/gpu-check.json`) and writes a log per step
under `$OUT` (or `--out`): seven files, within what a device call brings back. It exits 1 if any
step failed. The dry run builds the wheel folder, checks that its wheels install for the image's
Python, then runs the same steps on the CPU on tiny shapes, the Triton kernels in Triton's
interpreter (TRITON_INTERPRET=1) and the engine on them (PAGEDBATCH_KERNELS=triton), as on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import wheels

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEFAULT_WHEELS = ROOT / ".gpu-wheels"
# What setup.py builds the wheel from: copied out, so that the build leaves nothing in the tree.
PROJECT_FILES = ["pyproject.toml", "setup.py", "README.md"]
PROJECT_UNITS = ["pagedbatch", "api", "engine", "kernels", "migrations", "store", "workers"]
# The Triton kernels' tests, and the decode steps' capture: CUDA graphs there, on a GPU.
KERNEL_TESTS = [
    *sorted(str(path) for path in (ROOT / "tests" / "kernels").glob("test_triton_*.py")),
    str(ROOT / "tests" / "engine" / "worker" / "test_decode_graphs.py"),
]


@dataclass(frozen=True)
class Plan:
    """What each step runs with, on the device or in the dry run."""

    device: str
    seconds: float  # the whole check's budget; a step gets what is left of it at most
    kernel_selection: list[str]  # pytest arguments that pick the kernel tests
    parity: list[str]
    throughput: list[str]
    attention: list[str]
    doors: list[str]
    env: dict[str, str] = field(default_factory=dict)


GPU = Plan(
    device="cuda",
    seconds=450.0,  # the 8 minutes on one H100, less the call's own start
    kernel_selection=[],
    parity=["--device", "cuda", "--size", "small", "--prompts", "8", "--max-tokens", "32"],
    throughput=["--device", "cuda", "--dtype", "bfloat16", "--size", "small", "--requests", "128"]
    + ["--hf-batch-sizes", "16,64", "--kv-cache-gib", "4", "--max-num-seqs", "128"],
    # The `medium` make-model shape's attention (the script's defaults), 64 sequences of 2048.
    attention=["--device", "cuda", "--dtype", "bfloat16"],
    doors=["--device", "cuda", "--dtype", "bfloat16", "--size", "small"],
)
DRY_RUN = Plan(
    device="cpu",
    seconds=300.0,
    # Each kernel in float32, attention on a mixed batch (decodes and prefills, grouped heads, a
    # window) in every dtype, and the engine end to end: the interpreter runs each slowly.
    kernel_selection=["-k", "mixed-gqa3-window7 or engine_gen or float32 and not torch_path"],
    # One architecture, to run the step's code; the engine tests check each one's parity on the
    # CPU, and the GPU run checks both.
    parity=["--device", "cpu", "--archs", "llama", "--size", "tiny", "--prompts", "1"]
    + ["--max-tokens", "4"],
    throughput=["--quick", "--requests", "2", "--min-output-len", "2", "--max-output-len", "4"]
    + ["--max-prompt-len", "12", "--hf-batch-sizes", "2", "--kv-cache-gib", "0.05"],
    attention=["--device", "cpu", "--batch", "2", "--context", "64", "--iters", "2"],
    doors=["--device", "cpu", "--dtype", "float32", "--size", "tiny", "--max-tokens", "2"],
    env={"TRITON_INTERPRET": "1", "PAGEDBATCH_KERNELS": "triton"},
)


class Check:
    """One run: the steps' environment, their logs, the time left, the summary."""

    def __init__(self, plan: Plan, out: Path, work: Path, site: Path):
        self.plan = plan
        self.out = out
        self.work = work
        self.site = site
        self.deadline = time.monotonic() + plan.seconds
        self.summary: dict[str, Any] = {}
        # The engine's steps after the kernels': `--no-cuda-graphs` where the decode graphs'
        # own tests failed, so that one broken capture does not cost every later figure.
        self.engine_flags: list[str] = []
        # The installed project first, then the benchmarks' and tests' helper modules (harness,
        # greedy_checks), which are no part of the package.
        path = [str(site), str(ROOT / "benchmarks"), str(ROOT / "tests")]
        self.env = {**os.environ, **plan.env, "PYTHONPATH": os.pathsep.join(path)}
        self.env["PYTHONUNBUFFERED"] = "1"

    def run(self, name: str, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """`argv` with the check's environment, in its work folder (never the checkout's root,
        whose source folders are no importable package), its output kept in `<name>.log`."""
        left = self.deadline - time.monotonic()
        if left < 10:
            raise TimeoutError(f"no time left for {name}")
        with (self.out / f"{name}.log").open("a") as log:
            log.write(f"$ {' '.join(argv)}\n")
            log.flush()
            try:
                done = subprocess.run(
                    argv,
                    cwd=self.work,
                    env=self.env,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    timeout=min(timeout, left),
                )
            except subprocess.TimeoutExpired as e:
                log.write((e.stdout or b"").decode(errors="replace") if e.stdout else "")
                raise TimeoutError(f"{name} ran past {min(timeout, left):.0f} s") from None
            log.write(done.stdout)
        return done

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        started = time.monotonic()
        try:
            result = fn()
        except Exception as e:  # one step's failure is reported, and the others still run
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"[-1000:]}
        result["seconds"] = round(time.monotonic() - started, 1)
        self.summary[name] = result


def last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("the step printed no JSON line")


def python_step(check: Check, name: str, argv: list[str], timeout: float) -> dict[str, Any]:
    done = check.run(name, [sys.executable, *argv], timeout)
    report = last_json(done.stdout)
    if done.returncode != 0:
        report["ok"] = False
        report.setdefault("error", f"exit code {done.returncode}; see {name}.log")
    return report


def install(check: Check, wheel_folder: Path, dry_run: bool) -> dict[str, Any]:
    """The project into the check's site folder with `--no-deps`; on the device the carried
    wheels beside it. In the dry run the wheels are for the image's Python, not this one: they
    are installed as the image's pip would take them, into a folder of their own, and the
    steps use this environment's packages instead."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    figures: dict[str, Any] = {}
    if dry_run:
        built = wheels.build(wheel_folder)
        figures.update(wheel_count=built["wheel_count"], wheels_mib=built["wheels_mib"])
        wheels.check_installable(wheel_folder, check.work / "image-site")
        figures["image_install"] = "ok"
    else:
        if not (wheel_folder / wheels.MANIFEST).is_file():
            raise FileNotFoundError(
                f"no wheel folder at {wheel_folder}: build it with `.venv/bin/python "
                "scripts/gpu-check --build-wheels` and name it in the device call's carry"
            )
        manifest = json.loads((wheel_folder / wheels.MANIFEST).read_text())
        mib = round(wheels.folder_bytes(wheel_folder) / 2**20, 1)
        figures.update(wheel_count=len(manifest), wheels_mib=mib)
        found = [str(path) for path in sorted(wheel_folder.glob("*.whl"))]
        carried = [*pip, "install", "--no-index", "--no-deps", "--no-compile", "--target"]
        check.run("install", [*carried, str(check.site), *found], 300).check_returncode()
    source = check.work / "src"
    source.mkdir()
    for name in PROJECT_FILES:
        shutil.copy2(ROOT / name, source / name)
    for unit in PROJECT_UNITS:
        shutil.copytree(ROOT / unit, source / unit, ignore=shutil.ignore_patterns("__pycache__"))
    project = [*pip, "install", "--no-deps", "--no-build-isolation", "--no-index", "--target"]
    check.run("install", [*project, str(check.site), str(source)], 300).check_returncode()
    probe = check.run("install", [sys.executable, str(HERE / "probe.py"), check.plan.device], 120)
    figures.update(last_json(probe.stdout))
    # The steps must run the installed copy, not the checkout's sources.
    installed = Path(figures["pagedbatch"]).is_relative_to(check.site)
    figures["ok"] = probe.returncode == 0 and installed
    return figures


def kernels(check: Check) -> dict[str, Any]:
    report = check.work / "kernels.xml"
    argv = [sys.executable, "-m", "pytest", *KERNEL_TESTS, *check.plan.kernel_selection]
    argv += ["--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), "-p", "no:cacheprovider"]
    argv += ["-q", f"--junitxml={report}"]
    done = check.run("kernels", argv, 240)
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts: dict[str, Any] = {
        key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")
    }
    counts["ok"] = done.returncode == 0 and counts["tests"] > 0
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts["failed"] = failed[:20]
    if any("test_decode_graphs" in name for name in failed):
        check.engine_flags.append("--no-cuda-graphs")
        counts["cuda_graphs"] = "off for the later steps: the decode graphs' tests failed"
    return counts


def parity(check: Check) -> dict[str, Any]:
    argv = [str(HERE / "parity.py"), *check.plan.parity, *check.engine_flags]
    argv += ["--work", str(check.work / "parity")]
    return python_step(check, "parity", argv, 240)


def throughput(check: Check) -> dict[str, Any]:
    argv = [str(ROOT / "benchmarks" / "throughput.py"), *check.plan.throughput, *check.engine_flags]
    report = python_step(check, "throughput", argv, 240)
    ours, best = report.get("ours", {}), (report.get("transformers") or {}).get("best") or {}
    return {
        "ok": report.get("ok", True) and "output_tps" in ours and "output_tps" in best,
        "ours_output_tps": ours.get("output_tps"),
        "transformers_output_tps": best.get("output_tps"),
        "transformers_batch_size": best.get("batch_size"),
        "speedup_vs_transformers": report.get("speedup_vs_transformers"),
        "gemm_peak_gflops": report.get("gemm_peak_gflops"),
        "ours_mfu": ours.get("mfu"),
        "ours_est_gbps": ours.get("est_gbps"),
        "greedy_agreement_vs_transformers": report.get("greedy_agreement_vs_transformers"),
        "error": ours.get("error") or best.get("error") or report.get("error"),
    }


def attention(check: Check) -> dict[str, Any]:
    argv = [str(ROOT / "benchmarks" / "attention_bandwidth.py"), *check.plan.attention]
    report = python_step(check, "attention", argv, 120)
    keys = ("kernel", "dtype", "kernel_gbps", "reference_gbps", "fraction_of_reference")
    figures = {key: report.get(key) for key in (*keys, "max_abs_diff")}
    # bfloat16 against the torch path's own rounding, as the kernel tests allow.
    figures["ok"] = report.get("ok", True) and (report.get("max_abs_diff") or 1.0) < 3e-2
    return figures


def doors(check: Check) -> dict[str, Any]:
    argv = [str(HERE / "doors.py"), *check.plan.doors, *check.engine_flags]
    argv += ["--work", str(check.work / "doors")]
    return python_step(check, "doors", argv, 240)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="every step on this CPU machine")
    mode.add_argument("--build-wheels", action="store_true", help="only the wheel folder")
    p.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS, help="the wheel folder")
    p.add_argument("--out", type=Path, help="logs and the summary (default: $OUT, else a new tmp)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build_wheels:
        figures = wheels.build(args.wheels)
        print(json.dumps({"folder": str(args.wheels), **figures}))
        return 0
    started = time.monotonic()
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    plan = DRY_RUN if args.dry_run else GPU
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        check = Check(plan, out, work, work / "site")
        check.step("install", lambda: install(check, args.wheels, args.dry_run))
        if check.summary["install"]["ok"]:
            check.step("kernels", lambda: kernels(check))
            check.step("parity", lambda: parity(check))
            check.step("doors", lambda: doors(check))
            check.step("attention", lambda: attention(check))
            check.step("throughput", lambda: throughput(check))
    summary = {
        "mode": "dry-run" if args.dry_run else "gpu",
        "ok": all(step["ok"] for step in check.summary.values()) and len(check.summary) == 6,
        "seconds": round(time.monotonic() - started, 1),
        **check.summary,
    }
    line = json.dumps(summary)
    (out / "gpu-check.json").write_text(line + "\n")
    print(line, flush=True)
    return 0 if summary["ok"] else 1

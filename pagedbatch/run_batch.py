"""`pagedbatch run-batch`: an OpenAI batch input file through a local model, without a server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from pagedbatch.engine import AsyncLLM
from pagedbatch.protocol.batch_lines import BatchOutputLine
from pagedbatch.protocol.pipeline import RequestContext
from pagedbatch.service import start_embedder, start_guard
from pagedbatch.settings import Settings
from pagedbatch.store.models import DEFAULT_OWNER
from pagedbatch.workers.batches.runner import BatchProgress, BatchRunner

# tqdm's ETA comes from the rate lines finish at; the postfix adds tokens/s and failures.
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} lines [{elapsed} elapsed, ETA {remaining}{postfix}]"


def run_batch(
    input_path: str | Path,
    output_path: str | Path,
    model_dir: str | Path,
    *,
    show_progress: bool = True,
    **engine_args: Any,
) -> BatchProgress:
    """Writes one output line to `output_path` per input line, as each finishes.

    `engine_args` are EngineArgs fields (max_num_seqs, num_kv_blocks, served_model_name, ...).
    With `show_progress`, a progress bar on stderr shows lines, tokens/s and the ETA. Lines are
    screened as the service's settings say (PAGEDBATCH_SAFETY_*; the moderation model of
    PAGEDBATCH_MODERATION_MODEL, where one is set), as the default tenant's batch lines.
    `/v1/embeddings` lines run on the model of PAGEDBATCH_EMBEDDING_MODEL where one is set, else
    on `model_dir`'s.
    """
    settings = Settings()
    engine = AsyncLLM(str(model_dir), **engine_args)
    guard = embedder = None
    try:
        guard = start_guard(settings)
        embedder = start_embedder(settings)
        context = RequestContext.of(
            settings, DEFAULT_OWNER, door="batch", guard=guard, moderation=False
        )
        runner = BatchRunner(
            engine,
            context,
            max_in_flight=2 * engine.engine.args.max_num_seqs,
            embedder=embedder,
        )
        return _run(runner, input_path, output_path, show_progress)
    finally:
        engine.shutdown()
        for side in (guard, embedder):
            if side is not None:
                side.shutdown()


def _run(
    runner: BatchRunner, input_path: str | Path, output_path: str | Path, show_progress: bool
) -> BatchProgress:
    # Bytes, not text: a line that is not UTF-8 becomes an error line instead of ending the run.
    with (
        open(input_path, "rb") as source,
        open(output_path, "w", encoding="utf-8", buffering=1) as sink,
        tqdm(
            total=_count_lines(input_path),
            desc="run-batch",
            bar_format=BAR_FORMAT,
            disable=not show_progress,
        ) as bar,
    ):

        def write(line: BatchOutputLine) -> None:
            sink.write(line.model_dump_json() + "\n")

        def on_progress(progress: BatchProgress) -> None:
            rate = progress.generated_tokens / max(bar.format_dict["elapsed"], 1e-3)
            bar.set_postfix_str(f"{rate:.1f} tok/s, {progress.lines_failed} failed", refresh=False)
            bar.update(progress.lines_done - bar.n)

        return runner.run(source, write, on_progress)


def _count_lines(path: str | Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())

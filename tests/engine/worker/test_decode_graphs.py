"""Decode steps from captures (engine/worker/decode_graphs.py) against the same steps run eagerly
by the model runner: the same logits for batches padded to their bucket, contexts crossing block
boundaries and a sliding window shorter than some of them, and padding rows that touch nothing
but the null block; and the engine, whose runner captures them, generating the eager tokens.

On a GPU the captures are CUDA graphs; elsewhere they replay eagerly (EagerReplay), the Triton
kernels running in Triton's interpreter, with what the kernels take from the host frozen at
capture exactly as a graph freezes it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.config import EngineArgs, ModelConfig
from pagedbatch.engine.worker import decode_graphs
from pagedbatch.engine.worker.decode_graphs import (
    CudaGraphReplay,
    DecodeGraphs,
    EagerReplay,
    bucket_sizes,
)
from pagedbatch.engine.worker.model_runner import ModelRunner, StepInput
from pagedbatch.kernels import ops

BLOCK = 4
WIDTH = 6  # blocks per sequence: 24 positions
NUM_SEQS = 8
STEPS = 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def triton_kernels(monkeypatch):
    """The graphs run the Triton kernels (the torch ones read host lists a capture freezes)."""
    monkeypatch.setenv(ops.SETTING, "triton")
    ops.reset()
    yield
    ops.reset()


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(4) == [1, 2, 4]
    assert bucket_sizes(5) == [1, 2, 4, 8]
    assert bucket_sizes(10) == [1, 2, 4, 8, 16]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert bucket_sizes(50) == [1, 2, 4, 8, 16, 32, 48, 64]


def runner_and_graphs(model_dir, device: str = DEVICE) -> tuple[ModelRunner, DecodeGraphs]:
    # One block more than the sequences use: the null block, last.
    args = EngineArgs(
        model=str(model_dir),
        device=device,
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=NUM_SEQS * WIDTH + 1,
        max_num_seqs=NUM_SEQS,
        cuda_graphs=False,  # the test captures its own, below
    )
    runner = ModelRunner(ModelConfig.load(model_dir), args)
    replay = CudaGraphReplay(runner.device) if device == "cuda" else EagerReplay()
    graphs = DecodeGraphs(
        lambda ids, positions, meta: runner.model(ids, positions, runner.kv_caches, meta),
        replay,
        max_num_seqs=NUM_SEQS,
        table_width=WIDTH,
        block_size=BLOCK,
        null_block=NUM_SEQS * WIDTH,
        device=runner.device,
    )
    return runner, graphs


def table(count: int, width: int) -> np.ndarray:
    """Sequence i's blocks, out of order across sequences: i, i + 8, i + 16, ..."""
    return (np.arange(width)[None, :] * NUM_SEQS + np.arange(count)[:, None]).astype(np.int32)


def slots_of(tables: np.ndarray, seq_lens: list[int]) -> list[int]:
    return [
        int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(seq_lens)
    ]


@pytest.mark.parametrize(
    ("arch", "overrides", "prompt_lens"),
    [("llama", {}, [5, 9, 3]), ("mistral", {"sliding_window": 7}, [4, 12, 7, 1, 8])],
    ids=["llama-3seqs", "mistral-window7-5seqs"],
)
def test_replayed_decode_steps_give_the_eager_logits(make_checkpoint, arch, overrides, prompt_lens):
    runner, graphs = runner_and_graphs(make_checkpoint(arch, **overrides))
    rng = np.random.default_rng(0)
    count = len(prompt_lens)
    # The step's own table is as wide as its longest sequence needs, as the engine's is.
    width = -(-(max(prompt_lens) + STEPS) // BLOCK)
    tables = table(count, width)
    prompts = [rng.integers(10, 8000, n).tolist() for n in prompt_lens]
    starts = np.cumsum([0, *prompt_lens]).tolist()
    prefill = StepInput(
        input_ids=[t for p in prompts for t in p],
        query_start_loc=starts,
        seq_lens=list(prompt_lens),
        block_tables=tables,
        sample_rows=[s - 1 for s in starts[1:]],
    )
    tokens = runner.run(prefill).argmax(-1).tolist()
    seq_lens = list(prompt_lens)
    null = slice(graphs.null_slot, graphs.null_slot + BLOCK)
    for _ in range(STEPS):
        seq_lens = [n + 1 for n in seq_lens]
        step = StepInput(
            input_ids=tokens,
            query_start_loc=list(range(count + 1)),
            seq_lens=seq_lens,
            block_tables=tables,
            sample_rows=list(range(count)),
        )
        eager = runner.run(step)
        caches = [c for layer in runner.kv_caches for c in layer]
        before = [c.clone() for c in caches]
        hidden = graphs.run(step.input_ids, step.seq_lens, step.block_tables)
        with torch.inference_mode():
            replayed = runner.model.compute_logits(hidden).float()
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0)
        assert replayed.argmax(-1).tolist() == eager.argmax(-1).tolist()
        # The step's own slots are rewritten (with the same keys and values, to float32's last
        # bits), the null block is the padding rows'; nothing else changes.
        written = slots_of(tables, seq_lens)
        for old, cache in zip(
            before, (c for layer in runner.kv_caches for c in layer), strict=True
        ):
            old, new = old.flatten(0, 1), cache.flatten(0, 1)
            torch.testing.assert_close(new[written], old[written], atol=1e-5, rtol=0)
            untouched = torch.ones(len(old), dtype=torch.bool)
            untouched[written] = False
            untouched[null] = False
            # Slots never written hold whatever the allocation held, NaN included.
            torch.testing.assert_close(
                new[untouched], old[untouched], atol=0, rtol=0, equal_nan=True
            )
        tokens = eager.argmax(-1).tolist()
    assert graphs.replayed == STEPS


def test_steps_no_capture_holds_run_eagerly(make_checkpoint):
    _, graphs = runner_and_graphs(make_checkpoint("llama"))
    too_many = NUM_SEQS + 1
    assert graphs.run([1] * too_many, [1] * too_many, table(too_many, 1)) is None
    assert graphs.run([1], [1], table(1, WIDTH + 1)) is None
    assert graphs.replayed == 0


def test_the_engine_decodes_through_its_captures(make_checkpoint, monkeypatch):
    """Prompts that cross blocks, of several lengths, so that steps mix prefill chunks and pure
    decodes and batches shrink as requests end (each size padded to its bucket), on a model
    with a sliding window shorter than the longest."""
    if DEVICE == "cpu":  # a GPU captures CUDA graphs of its own accord
        monkeypatch.setattr(decode_graphs, "graph_replay", lambda device: EagerReplay())
    model = make_checkpoint("mistral", sliding_window=7)
    prompts = [[11, 502, 73, 9, 1200, 64, 31, 880, 7], [5, 17, 401], [88, 3000, 21, 4, 6, 7]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 3, 5)]

    def generate(cuda_graphs: bool) -> tuple[list[list[int]], LLM]:
        llm = LLM(
            model,
            device=DEVICE,
            dtype="float32",
            block_size=BLOCK,
            num_kv_blocks=24,
            max_num_seqs=4,
            max_num_batched_tokens=8,
            cuda_graphs=cuda_graphs,
        )
        return [out.token_ids for out in llm.generate(prompts, params)], llm

    eager, llm = generate(cuda_graphs=False)
    assert llm.engine.core.runner.decode_graphs is None
    replayed, llm = generate(cuda_graphs=True)
    assert replayed == eager
    assert llm.engine.core.runner.decode_graphs.replayed > 0

"""Decode steps replayed from captured CUDA graphs, one graph per batch-size bucket, as vLLM and
nano-vllm do: a small model's decode step is mostly kernel launches (hundreds a step, each some
microseconds of CPU), and a graph replays them all at the cost of one.

A graph replays its kernels on the tensors it was captured with, so every input lives in a
static buffer sized for the largest bucket. A step copies its batch in, pads it to the next
bucket with rows that read and write only the null block (a KV-cache block the block pool never
hands out), replays, and reads its own rows of the output. What the kernels take from the host
is frozen at capture too: the metadata's `max_query_len` (1) and `max_seq_len` (the table's whole
width) choose the Triton attention kernel's tiles and its sliding-window path, which are right
for every decode step that fits the table. The torch reference kernels read per-sequence host
lists instead: graphs need the Triton kernels.

`Replay` is how a captured step runs again. `CudaGraphReplay` captures a CUDA graph;
`EagerReplay` runs the same function again on the same buffers, which is what a replay computes,
so that on the CPU (the Triton kernels in Triton's interpreter) everything here but the capture
itself is checked (tests/engine/worker/test_decode_graphs.py). ModelRunner captures them at start
where they apply (`cuda_graphs`, on by default) and runs plain decode steps through them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from pagedbatch.kernels.attention import AttentionMetadata

Step = Callable[[], torch.Tensor]
# One model call on the buffers: (input_ids, positions, metadata) -> hidden states.
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then the multiples of 16, up to the first size that holds `max_num_seqs`."""
    sizes: list[int] = []
    for size in (*SMALL_BUCKETS, *range(BUCKET_STEP, max_num_seqs + BUCKET_STEP, BUCKET_STEP)):
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return sizes


class Replay(Protocol):
    def capture(self, step: Step) -> Step:
        """`step` made replayable: the returned callable computes what `step` does, on the
        same buffers, and returns the same output tensor."""
        ...


class EagerReplay:
    """Runs the step again: what a graph's replay computes, without CUDA."""

    def capture(self, step: Step) -> Step:
        step()  # as a capture's warm-up does: the Triton kernels compile now
        return step


class CudaGraphReplay:
    """A CUDA graph per step; the graphs share one memory pool (captured largest first, the
    smaller ones fit in what the largest took)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: tuple[int, int] | None = None

    def capture(self, step: Step) -> Step:
        with torch.cuda.device(self.device):  # the runner's, which need not be the current one
            # Warm-up on a side stream, outside the graph: Triton compiles and cuBLAS chooses
            # its kernels there, which a capture must not see.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = step()
        self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


def graph_replay(device: torch.device) -> Replay | None:
    """How captured decode steps replay on `device`: CUDA graphs on a GPU; none elsewhere, where
    steps run eagerly (the tests swap in EagerReplay to run the ModelRunner's graph path)."""
    return CudaGraphReplay(device) if device.type == "cuda" else None


class DecodeGraphs:
    """Captured decode steps for batches of up to `max_num_seqs` sequences whose block tables
    are at most `table_width` blocks wide."""

    # Inference mode around the capture and each step: the buffers are inference tensors, which
    # only inference mode may write, and the model's calls keep no autograd state.
    @torch.inference_mode()
    def __init__(
        self,
        forward: Forward,
        replay: Replay,
        *,
        max_num_seqs: int,
        table_width: int,
        block_size: int,
        null_block: int,
        device: torch.device,
    ):
        self.sizes = bucket_sizes(max_num_seqs)
        self.block_size = block_size
        self.null_block = null_block
        self.null_slot = null_block * block_size
        rows = self.sizes[-1]
        # Padding rows: one token at position 0 of a sequence held in the null block.
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), self.null_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.full(
            (rows, table_width), null_block, dtype=torch.int32, device=device
        )
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int64, device=device)
        self.replayed = 0  # steps run from a capture, for tests and stats
        self._steps: dict[int, Step] = {}
        for size in reversed(self.sizes):
            meta = self._metadata(size, max_seq_len=table_width * block_size)
            ids, positions = self.input_ids[:size], self.positions[:size]
            self._steps[size] = replay.capture(lambda i=ids, p=positions, m=meta: forward(i, p, m))

    def _metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        seq_lens = self.seq_lens[:size]
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=seq_lens,
            block_tables=self.block_tables[:size],
            block_size=self.block_size,
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            rope_seq_lens=seq_lens,  # one token per sequence
            max_query_len=1,
            max_seq_len=max_seq_len,
            # Read by the torch kernels alone, which graphs do not run.
            _query_lens=[1] * size,
            _seq_lens=[max_seq_len] * size,
        )

    @torch.inference_mode()
    def run(
        self, input_ids: Sequence[int], seq_lens: Sequence[int], block_tables: np.ndarray
    ) -> torch.Tensor | None:
        """The hidden states of a decode step (one new token per sequence; `block_tables` row i
        is sequence i's), or None where no capture holds it (too many sequences, or a table
        wider than the captured one): the caller then runs it eagerly."""
        count = len(seq_lens)
        if count > self.sizes[-1] or block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        size = next(size for size in self.sizes if size >= count)
        lens = np.asarray(seq_lens, dtype=np.int64)
        positions = lens - 1
        blocks = block_tables[np.arange(count), positions // self.block_size].astype(np.int64)
        slots = blocks * self.block_size + positions % self.block_size
        _fill(self.input_ids, np.asarray(input_ids, dtype=np.int64), size, 0)
        _fill(self.positions, positions, size, 0)
        _fill(self.seq_lens, lens, size, 1)
        _fill(self.slot_mapping, slots, size, self.null_slot)
        # Columns past the step's width keep older steps' blocks: the kernel never reads a
        # block past a sequence's length.
        self.block_tables[:count, : block_tables.shape[1]].copy_(torch.from_numpy(block_tables))
        self.block_tables[count:size].fill_(self.null_block)
        hidden = self._steps[size]()
        self.replayed += 1
        return hidden[:count]


def _fill(buffer: torch.Tensor, values: np.ndarray, size: int, padding: int) -> None:
    count = len(values)
    buffer[:count].copy_(torch.from_numpy(values))
    buffer[count:size].fill_(padding)

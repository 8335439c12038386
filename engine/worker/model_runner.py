"""One tensor-parallel rank's model shard and KV cache; runs one flattened batch per step.

An embedding model's step returns each scheduled chunk's pooled row (see `pooler`) where a
language model's returns logits; an encoder (BERT) has no KV cache at all.

Rank 0 (the engine's process) turns the scheduler's decisions into a `StepInput`; with more than
one rank, `ranks.RankProcesses` hands the same input to every other rank, and all of them run it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedbatch.engine.config import DTYPES, EngineArgs, ModelConfig
from pagedbatch.engine.core.encoder_cache import EncoderWork
from pagedbatch.engine.core.scheduler import ScheduledRequest
from pagedbatch.engine.lora.resident import ResidentLoras
from pagedbatch.engine.sample.greedy import greedy_tokens
from pagedbatch.engine.sample.prompt_logprobs import (
    PromptRows,
    ScoredRows,
    prompt_rows,
    score_rows,
)
from pagedbatch.engine.worker import decode_graphs, distributed
from pagedbatch.engine.worker.decode_graphs import DecodeGraphs
from pagedbatch.engine.worker.distributed import SINGLE, TensorParallel
from pagedbatch.engine.worker.host_memory import (
    FreedMemory,
    cpu_kv_budget_bytes,
    keep_freed_memory,
    peak_rss_mib,
    release_freed_memory,
)
from pagedbatch.engine.worker.loader import iterate_weights
from pagedbatch.engine.worker.lora_linears import attach_loras
from pagedbatch.engine.worker.models.encoder_attention import length_groups
from pagedbatch.engine.worker.models.registry import resolve_model_class
from pagedbatch.engine.worker.parallel_layers import (
    bfloat16_weights,
    pack_weights,
    quantize_linears,
)
from pagedbatch.engine.worker.pooler import pool_chunks
from pagedbatch.engine.worker.quantization import resolve_quantization
from pagedbatch.engine.worker.shard_threads import ShardThreads
from pagedbatch.kernels import kv_quant, native, ops
from pagedbatch.kernels.attention import prepare_attention

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pagedbatch.engine.worker.ranks import RankProcesses

GPU_MEMORY_FRACTION = 0.9
# The text decoders whose decode steps replay from captures (see ModelRunner._graphs_apply).
GRAPH_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# An encoder batch's rows are padded to a multiple of this (see ModelRunner._encode_sequences).
ENCODER_ROWS_MULTIPLE = 32


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rank_device(name: str, rank: int, size: int) -> torch.device:
    """The device of `rank` of `size`: on CUDA, one device per rank, counting up from `name`'s."""
    device = resolve_device(name)
    if size == 1 or device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on cpu or cuda devices, not {device.type}")
    first, count = device.index or 0, torch.cuda.device_count()
    if first + size > count:
        raise ValueError(
            f"tensor_parallel_size {size} needs CUDA devices {first} to {first + size - 1}; "
            f"{count} visible"
        )
    return torch.device("cuda", first + rank)


HALF_DTYPES = (torch.bfloat16, torch.float16)
# The CPU flags (Linux's names) of a native bfloat16 dot product: AVX512-BF16's vdpbf16ps, AMX's
# tiles. Without either, oneDNN emulates bfloat16: float32's arithmetic plus the conversions.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (its flags hold one of NATIVE_BF16_FLAGS)."""
    return bool(NATIVE_BF16_FLAGS & native.cpu_flags())


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """`dtype` as it applies; bfloat16 on a CPU without native bfloat16 (AVX512-BF16 or AMX, as
    its /proc/cpuinfo flags say) refused at start, where vLLM's CPU backend warns: emulated, it
    would cost float32's arithmetic and more, for bfloat16's precision."""
    if name == "bfloat16" and device.type == "cpu" and not native_bfloat16():
        raise ValueError(
            "dtype bfloat16 on CPU needs native bfloat16 (AVX512-BF16 or AMX: the avx512_bf16 "
            "or amx_bf16 flag in /proc/cpuinfo), which this CPU lacks; use dtype float32"
        )
    if name != "auto":
        return DTYPES[name]
    if device.type != "cuda":
        # Half precision on CPUs without AMX runs at about half the float32 rate.
        return torch.float32
    # On a GPU, half precision: tensor cores, and half the bytes of weights and KV cache read per
    # decode step. A half-precision checkpoint keeps its own (float16's range is what it was
    # trained in); a float32 one runs in bfloat16, whose range is float32's.
    return cfg.torch_dtype if cfg.torch_dtype in HALF_DTYPES else torch.bfloat16


def resolve_matmul_precision(
    name: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, cpu_flags: frozenset[str]
) -> str:
    """`matmul_precision` as it applies: bfloat16 only for a float32 model on CPU; auto chooses
    it for an embedding model where the CPU (its `cpu_flags`) multiplies bfloat16 natively, with
    AMX or AVX512-BF16: elsewhere bfloat16 matmuls run slower than float32's."""
    if name == "bfloat16" and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError("matmul_precision bfloat16 applies to float32 models on CPU only")
    if name != "auto":
        return name
    native_bf16 = NATIVE_BF16_FLAGS & cpu_flags
    fast = device.type == "cpu" and dtype == torch.float32 and native_bf16
    return "bfloat16" if fast and cfg.pooling is not None else "highest"


@dataclass
class StepInput:
    """One step's batch as plain lists and an array: what every rank needs to run it."""

    input_ids: list[int]
    query_start_loc: list[int]  # sequence i owns input_ids[query_start_loc[i]:[i + 1]]
    seq_lens: list[int]  # each sequence's context length after this step
    block_tables: np.ndarray  # [num_seqs, width] int32: row i is sequence i's, padded with 0
    sample_rows: list[int]  # the tokens whose next-token logits are wanted
    # A multimodal model's: the images and clips to encode (and cached outputs to drop first),
    # and the batch rows that take their embeddings: (first row, item hash, embeddings from, to).
    encoder: EncoderWork | None = None
    media_rows: list[tuple[int, bytes, int, int]] = field(default_factory=list)
    # A model with M-RoPE: every token's positions along time, height and width, [3, tokens].
    mrope_positions: np.ndarray | None = None
    # The rows whose logits score prompt tokens (requests asking for prompt logprobs).
    prompt_rows: PromptRows | None = None
    # Where LoRA adapters are served: each sequence's slot (lora.mapping.BASE: the base model).
    lora_slots: list[int] | None = None
    # Whether the sampled rows want their argmax alone: the step returns their token ids.
    greedy: bool = False

    @classmethod
    def build(
        cls,
        scheduled: list[ScheduledRequest],
        block_tables: np.ndarray,
        encoder: EncoderWork | None = None,
    ) -> StepInput:
        input_ids: list[int] = []
        # M-RoPE positions where a request has them (a Qwen2-VL prompt with images); text alone
        # sits at its indices on all three axes, which plain positions say.
        mrope = any(s.request.mrope_positions is not None for s in scheduled)
        mrope_columns: list[np.ndarray] = []
        query_start_loc = [0]
        sample_rows: list[int] = []
        media_rows: list[tuple[int, bytes, int, int]] = []
        first_rows: list[int] = []
        for s in scheduled:
            first_row = len(input_ids)
            first_rows.append(first_row)
            for item in s.request.media:
                start, end = max(s.start, item.offset), min(s.end, item.end)
                if start < end:
                    row = first_row + start - s.start
                    media_rows.append(
                        (row, item.content_hash, start - item.offset, end - item.offset)
                    )
            input_ids.extend(s.request.all_token_ids[s.start : s.end])
            if mrope:
                mrope_columns.append(_mrope_columns(s))
            query_start_loc.append(len(input_ids))
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
        scoring = prompt_rows(scheduled, first_rows)
        return cls(
            input_ids=input_ids,
            query_start_loc=query_start_loc,
            seq_lens=[s.end for s in scheduled],
            block_tables=block_tables,
            sample_rows=sample_rows,
            encoder=encoder,
            media_rows=media_rows,
            mrope_positions=np.concatenate(mrope_columns, axis=1) if mrope else None,
            prompt_rows=scoring if scoring.rows else None,
        )


def _mrope_columns(s: ScheduledRequest) -> np.ndarray:
    """The M-RoPE positions of a scheduled chunk, `[3, num_new_tokens]`: the prompt's table where
    the request has one, then each token's index plus the request's delta."""
    request = s.request
    table = request.mrope_positions
    known = table.shape[1] if table is not None else 0
    head = table[:, s.start : min(s.end, known)] if s.start < known else None
    tail = np.arange(max(s.start, known), s.end) + request.mrope_delta
    tail = np.broadcast_to(tail, (3, tail.size))
    return tail if head is None else np.concatenate([head, tail], axis=1)


def _plain_decode(step: StepInput) -> bool:
    """One new token per sequence, and text alone: what a captured decode step runs."""
    return (
        len(step.input_ids) == len(step.seq_lens)
        and step.encoder is None
        and not step.media_rows
        and step.mrope_positions is None
    )


class ModelRunner:
    def __init__(self, cfg: ModelConfig, args: EngineArgs, tp: TensorParallel = SINGLE):
        self.cfg = cfg
        self.tp = tp
        self.device = rank_device(args.device, tp.rank, tp.size)
        self.dtype = resolve_dtype(args.dtype, cfg, self.device)
        self.block_size = args.block_size
        self.num_kv_heads = cfg.num_kv_heads // tp.size  # this rank's share of the heads
        if self.device.type == "cpu":
            keep_freed_memory()
        # An encoder's steps split into shards run side by side on CPU (one rank only: ranks
        # meet in collectives, which threads would cross).
        sharded = cfg.encoder_only and self.device.type == "cpu" and tp.size == 1
        self.shard_threads = ShardThreads(torch.get_num_threads() if sharded else 1)
        started = time.perf_counter()
        # A step's matmuls have about as many rows as it has sequences when they decode, and as
        # it has tokens when they are embedded (prefill only). Shards' matmuls stay MKL's: a
        # packed weight's oneDNN call holds the GIL, and the shards would take turns.
        pooling = cfg.pooling is not None
        rows = args.max_num_batched_tokens if pooling else args.max_num_seqs
        self.matmul_precision = resolve_matmul_precision(
            args.matmul_precision, cfg, self.device, self.dtype, native.cpu_flags()
        )
        self.quantization = resolve_quantization(
            args.quantization, cfg, self.device, self.dtype, tp.size, self.matmul_precision
        )
        # What the KV cache stores its elements in: a float dtype, or int8 / float8 with a scale
        # per 32 elements of a row (kv_quant), which every attention path reads.
        self.kv_cache_dtype = kv_quant.storage_dtype(
            args.kv_cache_dtype, self.dtype, quantized_weights=self.quantization == "gguf"
        )
        self.loras = self._resident_loras(args)
        self.model = self._load_model(rows, pack=self.shard_threads.count < 2)
        if self.loras is not None:  # checked against the model's linears: after it is built
            for name, path in args.lora_paths().items():
                self.loras.load(name, path)
        self.load_seconds = time.perf_counter() - started
        if tp.rank == 0:
            logger.info(
                "loaded %s (%s, %s, matmuls %s) in %.1f s; peak RSS %.0f MiB",
                cfg.path,
                cfg.architecture,
                str(self.dtype).removeprefix("torch."),
                self.matmul_precision,
                self.load_seconds,
                peak_rss_mib(),
            )
        if self.device.type == "cpu":
            native.library()  # built (once per machine) or loaded now, not on the first request
        replay = decode_graphs.graph_replay(self.device) if args.cuda_graphs else None
        # Decode steps from captures (see decode_graphs): their padding rows write a null block,
        # one past the pool's, which it never hands out.
        capture = replay is not None and not cfg.encoder_only and self._graphs_apply()
        self.decode_graphs: DecodeGraphs | None = None
        if cfg.encoder_only:  # sequences run whole, in one step: nothing is kept between steps
            self.num_blocks = 0
            self.kv_caches = []
        else:
            blocks = args.num_kv_blocks or self._blocks_for_budget(args.kv_cache_memory_gib)
            # Rank 0's block ids address every rank's cache: all hold as many as the smallest.
            self.num_blocks = tp.min(blocks, self.device)
            self.kv_caches = [
                (self._empty_cache(capture), self._empty_cache(capture))
                for _ in range(cfg.num_layers)
            ]
        if capture:
            self.decode_graphs = self._capture_decode_graphs(args, replay)
        # The other ranks, on rank 0 of a group (set by `ranks.start_runner`).
        self.ranks: RankProcesses | None = None
        # Image and audio embeddings by content hash, as the engine's EncoderCache says (a
        # multimodal model's; every rank keeps its own copy).
        self.encoder_outputs: dict[bytes, torch.Tensor] = {}
        # The last step's scored prompt rows (its `prompt_rows`), beside the logits it returned.
        self.scored_prompt: ScoredRows | None = None
        # The C allocator's freed pages handed back (host_memory): the loader's copies now, the
        # steps' from time to time.
        self.freed_memory: FreedMemory | None = None
        if self.device.type == "cpu":
            release_freed_memory()
            self.freed_memory = FreedMemory()

    def _load_model(self, rows: int, pack: bool) -> torch.nn.Module:
        """The model with its weights; `rows`, the usual rows of a step's matmuls, sizes their
        packing (see parallel_layers.Packed), where they are packed."""
        model_cls = resolve_model_class(self.cfg.architecture)
        with torch.device(self.device), distributed.building_for(self.tp):
            model = model_cls(self.cfg)
        model = model.to(self.dtype)
        quantized = self.quantization == "gguf"
        model.load_weights(iterate_weights(self.cfg.path, keep_quantized=quantized))
        if self.loras is not None:
            attach_loras(model, self.loras)
        if quantized:
            count, nbytes = quantize_linears(model)
            logger.info(
                "%d linears compute on their GGUF blocks: %.1f MiB; the model's other "
                "parameters hold %.1f MiB",
                count,
                nbytes / 2**20,
                sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
            )
        if self.matmul_precision == "bfloat16":
            bfloat16_weights(model)
        elif pack:
            pack_weights(model, rows)
        return model.eval()

    def _resident_loras(self, args: EngineArgs) -> ResidentLoras | None:
        """The slots of LoRA adapters, where `lora_modules` names any or `enable_lora` is on:
        served on one rank's float weights of a text decoder."""
        if not (args.lora_paths() or args.enable_lora):
            return None
        refused = {
            "tensor_parallel_size above 1": self.tp.size > 1,
            "quantization gguf": self.quantization == "gguf",
            "an embedding model": self.cfg.pooling is not None,
        }
        if reasons := [reason for reason, applies in refused.items() if applies]:
            raise ValueError(f"LoRA adapters are not served with {', '.join(reasons)} yet")
        cpu_loras = args.max_cpu_loras or args.max_loras
        return ResidentLoras(args.max_loras, cpu_loras, args.max_lora_rank)

    @property
    def kv_cache_dtype_name(self) -> str:
        """The KV cache's dtype as kv_cache_dtype names it (auto as the dtype it resolved to)."""
        return kv_quant.dtype_name(self.kv_cache_dtype)

    @property
    def kv_bytes_per_block(self) -> int:
        """Keys and values of a block's tokens over every layer, a quantized cache's scales
        included: the budget divided by it is the number of blocks."""
        row = kv_quant.bytes_per_row(self.kv_cache_dtype, self.cfg.head_dim)
        return 2 * self.cfg.num_layers * self.num_kv_heads * row * self.block_size

    def _blocks_for_budget(self, gib: float | None) -> int:
        if gib is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * GPU_MEMORY_FRACTION
        else:
            # CPU ranks of one engine share the host's memory.
            budget = gib * 2**30 if gib is not None else cpu_kv_budget_bytes() / self.tp.size
        return max(1, int(budget // self.kv_bytes_per_block))

    def _empty_cache(self, null_block: bool) -> kv_quant.KVCacheTensor:
        rows = self.num_blocks + (1 if null_block else 0)
        shape = (rows, self.block_size, self.num_kv_heads, self.cfg.head_dim)
        # Uninitialised on purpose: attention only reads slots that were written.
        return kv_quant.empty_cache(shape, self.kv_cache_dtype, self.device)

    def _graphs_apply(self) -> bool:
        """Whether decode steps can replay from captures: one rank (no collectives), the Triton
        kernels (the torch ones read per-sequence host lists a capture would freeze), and a
        text decoder whose forward reads nothing per step from the host (dynamic-NTK RoPE
        indexes by each step's lengths; multimodal models take other inputs; LoRA adapters
        pick each step's rows by adapter)."""
        return (
            self.tp.size == 1
            and self.loras is None
            and self.cfg.pooling is None
            and self.cfg.architecture in GRAPH_ARCHITECTURES
            and ops.kernels_for(torch.empty(0, device=self.device)) is not ops.TORCH
            and not any(getattr(m, "rope_type", None) == "dynamic" for m in self.model.modules())
        )

    def _capture_decode_graphs(
        self, args: EngineArgs, replay: decode_graphs.Replay
    ) -> DecodeGraphs:
        started = time.perf_counter()
        longest = args.max_model_len or self.cfg.max_position_embeddings
        graphs = DecodeGraphs(
            lambda ids, positions, meta: self.model(ids, positions, self.kv_caches, meta),
            replay,
            max_num_seqs=args.max_num_seqs,
            table_width=-(-longest // self.block_size),
            block_size=self.block_size,
            null_block=self.num_blocks,
            device=self.device,
        )
        logger.info(
            "captured decode steps of %s sequences in %.1f s",
            ", ".join(map(str, graphs.sizes)),
            time.perf_counter() - started,
        )
        return graphs

    def execute(
        self,
        scheduled: list[ScheduledRequest],
        block_tables: np.ndarray,
        encoder: EncoderWork | None = None,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Run one step on every rank; returns float32 logits for the requests that sample, in
        order (an embedding model's: each scheduled chunk's pooled row, see `pooler`); with
        `greedy`, each such row's argmax over its logits instead (int64, see sample/greedy).
        `block_tables` holds the scheduled requests' rows, as `StepInput` says."""
        step = StepInput.build(scheduled, block_tables, encoder)
        step.greedy = greedy
        if self.loras is not None:
            step.lora_slots = [self.loras.slot(s.request.lora_name) for s in scheduled]
        if self.ranks is None:
            return self.run(step)
        return self.ranks.run(step, self.run)

    def run(self, step: StepInput) -> torch.Tensor:
        """This rank's part of a step; every rank returns the same logits (or pooled rows)."""
        out = self._run(step)
        if self.freed_memory is not None:
            self.freed_memory.after_step(len(step.input_ids) - len(step.seq_lens))
        return out

    @torch.inference_mode()
    def _run(self, step: StepInput) -> torch.Tensor:
        if self.cfg.encoder_only:
            return self._run_encoder(step)
        device = self.device
        if self.loras is not None:
            self.loras.start_step(step.lora_slots or [], step.query_start_loc, device)
        if self.decode_graphs is not None and _plain_decode(step):
            hidden = self.decode_graphs.run(step.input_ids, step.seq_lens, step.block_tables)
            if hidden is not None:
                return self._logits(hidden, step)
        meta = prepare_attention(
            query_start_loc=torch.tensor(step.query_start_loc, device=device),
            seq_lens=torch.tensor(step.seq_lens, device=device),
            block_tables=torch.from_numpy(step.block_tables).to(device),
            block_size=self.block_size,
        )
        input_ids = torch.tensor(step.input_ids, device=device)
        positions = meta.positions
        if step.mrope_positions is not None:
            positions = torch.from_numpy(step.mrope_positions).to(device)
        if step.encoder is not None:
            self._encode(step.encoder)
        if step.media_rows:
            rows, embeds = self._media_embeddings(step.media_rows)
            hidden = self.model(input_ids, positions, self.kv_caches, meta, rows, embeds)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if self.cfg.pooling is not None:
            return pool_chunks(hidden, step.query_start_loc, self.cfg.pooling.pooling_type)
        return self._logits(hidden, step)

    def _logits(self, hidden: torch.Tensor, step: StepInput) -> torch.Tensor:
        """The sampled rows' logits, or their argmax (`step.greedy`); the prompt rows' scores
        kept in `scored_prompt`."""
        scoring = step.prompt_rows
        compute = self.model.compute_logits
        self.scored_prompt = None if scoring is None else score_rows(hidden, scoring, compute)
        rows = torch.tensor(step.sample_rows, dtype=torch.long, device=hidden.device)
        if not step.greedy:
            return compute(hidden[rows]).float()
        vocab = self.cfg.vocab_size if self.model.slices_vocabulary else None
        return greedy_tokens(hidden[rows], compute, vocab, self.model.screen)

    def _run_encoder(self, step: StepInput) -> torch.Tensor:
        """An encoder's step: whole sequences, packed, pooled; the pooled rows in the step's
        order. On CPU the sequences are dealt, shortest first, into one shard per torch thread,
        run side by side (see `shard_threads`)."""
        bounds = np.asarray(step.query_start_loc)
        lengths = np.diff(bounds)
        order = np.argsort(lengths, kind="stable")
        count = min(self.shard_threads.count, len(order))
        shards = [order[i::count] for i in range(count)]
        input_ids = torch.tensor(step.input_ids)
        pooled = self.shard_threads.map(
            lambda sequences: self._encode_sequences(input_ids, bounds, sequences), shards
        )
        out = torch.empty(len(order), pooled[0].shape[1], dtype=pooled[0].dtype)
        for shard, rows in zip(shards, pooled, strict=True):
            out[torch.from_numpy(shard)] = rows.cpu()
        return out.to(self.device)

    def _encode_sequences(
        self, input_ids: torch.Tensor, bounds: np.ndarray, sequences: np.ndarray
    ) -> torch.Tensor:
        """The pooled rows of `sequences` (indices into the step's, shortest first), encoded as
        one packed batch: those of equal length attend together (see `encoder_attention`).

        The batch is padded to a multiple of ENCODER_ROWS_MULTIPLE rows with one sequence of
        token 0 that nothing reads: where weights are packed, oneDNN builds a matmul anew
        (milliseconds) for every row count it has not seen, and a batch's token count is a sum
        of lengths that varies from step to step, so that otherwise most steps would pay it."""
        lengths = bounds[1:][sequences] - bounds[:-1][sequences]
        # Sequence i starts at row firsts[i]; each token's index in its sequence, and its index
        # in the step's tokens.
        firsts = np.cumsum(lengths) - lengths
        num_tokens = int(lengths.sum())
        positions = np.arange(num_tokens) - np.repeat(firsts, lengths)
        rows = np.repeat(bounds[:-1][sequences], lengths) + positions
        groups = length_groups(lengths.tolist())
        padding = -num_tokens % ENCODER_ROWS_MULTIPLE
        ids = input_ids[torch.from_numpy(rows)]
        if padding:
            ids = torch.cat([ids, ids.new_zeros(padding)])
            positions = np.concatenate([positions, np.arange(padding)])
            groups.append((num_tokens, 1, padding))
        device = self.device
        hidden = self.model(ids.to(device), torch.from_numpy(positions).to(device), groups)
        bounds_here = [*firsts.tolist(), num_tokens]
        return pool_chunks(hidden[:num_tokens], bounds_here, self.cfg.pooling.pooling_type)

    def _encode(self, work: EncoderWork) -> None:
        """Drop what the cache evicted, then encode the new images or clips, all at once."""
        for content_hash in work.free:
            del self.encoder_outputs[content_hash]
        if work.encode:
            embeddings = self.model.encode(work.encode)
            for item, embeds in zip(work.encode, embeddings, strict=True):
                self.encoder_outputs[item.content_hash] = embeds

    def _media_embeddings(
        self, media_rows: list[tuple[int, bytes, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch rows that hold media positions, and their embeddings in the same order."""
        rows = [torch.arange(row, row + end - start) for row, _, start, end in media_rows]
        embeds = [self.encoder_outputs[h][start:end] for _, h, start, end in media_rows]
        return torch.cat(rows).to(self.device), torch.cat(embeds)

    def shutdown(self) -> None:
        """Stops the other ranks, if any, and the shard threads."""
        self.shard_threads.shutdown()
        if self.ranks is not None:
            self.ranks.shutdown()

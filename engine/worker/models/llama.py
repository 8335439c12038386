"""The Llama family (Llama, Mistral, Qwen2) over a flattened token batch and a paged KV cache.

The three differ only in what config.json switches on: Qwen2's q/k/v biases, Mistral's and Qwen2's
sliding windows. Q/K/V and gate/up projections are fused into one matmul each; the loader splits
the checkpoint's separate tensors into them.

Built under `distributed.building_for(tp)`, a model holds one tensor-parallel rank's share: its
attention heads, its slice of the MLP and of the vocabulary (see parallel_layers).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.models.rope import RotaryEmbedding
from pagedbatch.engine.worker.models.weights import ParameterLoads
from pagedbatch.engine.worker.parallel_layers import (
    EVERY_TOKEN,
    Bfloat16Weight,
    ColumnParallelLinear,
    Loaded,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedbatch.kernels import native, ops
from pagedbatch.kernels.attention import AttentionMetadata
from pagedbatch.kernels.decode_layer import (
    CACHE_DTYPES,
    QKV_RUNS,
    DecodeLayer,
    DecodeStep,
    GemmaNorms,
    LayerShape,
    fusable,
    run_layer,
    takes,
)
from pagedbatch.kernels.quant_blocks import Format
from pagedbatch.kernels.quant_linear import QuantizedWeight

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual stream); with `residual`, adds it to x first."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias
        )
        # This rank's heads.
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, "the attention output"
        )
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotate(positions, q, k, meta)
        key_cache, value_cache = kv_cache
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = self.attend(q, key_cache, value_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries `[T, heads, D]` and keys `[T, kv_heads, D]` as attention reads and caches them:
        rotated by position. (A subclass may transform them first: Gemma 3 normalises them.)"""
        return self.rotary(positions, q, k, meta.rope_seq_lens)

    def attend(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Each query's attention over its sequence's cached keys. (A subclass may score them
        otherwise: Gemma 2 soft-caps the scores.)"""
        return ops.paged_attention(q, key_cache, value_cache, meta, self.scale, self.sliding_window)


class QKNormAttention(Attention):
    """Attention whose heads' queries and keys are normalised over head_dim before RoPE (q_norm,
    k_norm: one weight shared by every head), as Qwen3's and Gemma 3's are."""

    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None):
        super().__init__(cfg, rotary, sliding_window)
        self.q_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps)

    def rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, _ = self.q_norm(q)
        k, _ = self.k_norm(k)
        return super().rotate(positions, q, k, meta)


# Tokens whose MLP runs at once on the CPU. A prefill step's gate and up projections for all its
# tokens are [tokens, 2 x intermediate] float32, beside the activation and the down projection's
# input: for SmolLM2's 2,048 tokens 24, 12 and 12 MiB, held while they last and kept by malloc
# after. In chunks of 512 tokens a quarter of that; each chunk expands a quantized weight's blocks
# once more (quant_gemm: about 1% of a 2,048-token step a chunk).
MLP_CHUNK_ROWS = 512


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [inter, inter], bias=False, what="intermediate_size"
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step's few rows are one chunk: the weights' checks are for prefills alone.
        if x.shape[0] <= MLP_CHUNK_ROWS or not self.chunkable(x):
            return self.rows(x)
        return in_row_chunks(self.rows, x, MLP_CHUNK_ROWS)

    def chunkable(self, x: torch.Tensor) -> bool:
        """Whether chunks of x's rows compute what all of them at once would: in float32 on the
        CPU, whose kernels (MKL's, oneDNN's packed, quant_linear's) sum a row alike at any row
        count (tests/engine/worker/test_mlp_chunks.py). Not in bfloat16, whose oneDNN products
        part by the last bit at some row counts; not on CUDA, whose GEMMs may split a sum by the
        row count; not with LoRA adapters, whose deltas are laid out by the step's rows."""
        linears = (self.gate_up_proj, self.down_proj)
        return (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and all(
                m.weight.dtype == torch.float32
                and not isinstance(m.packed, Bfloat16Weight)
                and m.lora is None
                for m in linears
            )
        )

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of rows `x`: each output row depends on its own input row alone."""
        return self.down_proj(self.activation(self.gate_up_proj(x)))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gate and up projections (side by side) to the down projection's input."""
        return ops.silu_and_mul(gate_up)


def in_row_chunks(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int
) -> torch.Tensor:
    """`fn(x)` for a function that maps each row of x alone, computed over near-equal chunks of
    at most `rows` rows into one output: the same values where fn's kernels compute a row the
    same way at any row count, with fn's intermediates a chunk's size. Near-equal, so that no
    chunk is a remainder of a few rows, which a linear would take its few-row kernel for
    (quant_linear.small_batch()), whose sums are ordered otherwise."""
    total = x.shape[0]
    if total <= rows:
        return fn(x)
    count = -(-total // rows)
    bounds = [total * i // count for i in range(count + 1)]
    out: torch.Tensor | None = None
    for start, end in itertools.pairwise(bounds):
        part = fn(x[start:end])
        if out is None:
            out = part.new_empty((total, *part.shape[1:]))
        out[start:end] = part
    assert out is not None
    return out


class DecoderLayer(nn.Module):
    # What a variant of the same layer changes (Qwen3's normalised queries and keys, an MoE).
    attention_class: type[Attention] = Attention
    mlp_class: type[nn.Module] = MLP

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_class(cfg, rotary, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.mlp_class(cfg)

    def decode_layer(self, kv_cache: KVCache) -> DecodeLayer | None:
        """This layer as `decode_layer.c` computes it (see `fused_layer`); None for a subclass
        or parts that change what it computes."""
        if not (
            type(self) is DecoderLayer
            and type(self.self_attn) is Attention
            and type(self.mlp) is MLP
            and type(self.input_layernorm) is RMSNorm
            and type(self.post_attention_layernorm) is RMSNorm
        ):
            return None
        norms = (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        return fused_layer(self.self_attn, self.mlp, norms, self.input_layernorm.eps, kv_cache)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def decode_layers(layers: Iterable[nn.Module], kv_caches: list[KVCache]) -> list[DecodeLayer]:
    """The layers as `decode_layer.c` runs them on a decode step, where every one says it can be
    (its `decode_layer`) and the C kernels are built; [] where any cannot."""
    if native.library() is None:
        return []
    fused = []
    for layer, kv_cache in zip(layers, kv_caches, strict=True):
        one = layer.decode_layer(kv_cache) if hasattr(layer, "decode_layer") else None
        if one is None:
            return []
        fused.append(one)
    return fused


def fused_layer(
    attn: Attention,
    mlp: MLP,
    norms: tuple[torch.Tensor, torch.Tensor],
    eps: float,
    kv_cache: KVCache,
    gemma: GemmaNorms | None = None,
) -> DecodeLayer | None:
    """A layer of these parts as `decode_layer.c` computes it (the caller has checked that their
    classes are the ones it computes), where its linears are on quantized weights without
    biases, its rotary table is fixed and its KV cache float32, float16 or bfloat16; None
    otherwise."""
    key_cache, value_cache = kv_cache
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not (
        type(attn.rotary) is RotaryEmbedding
        and attn.rotary.rope_type != "dynamic"
        and key_cache.dtype == value_cache.dtype
        and key_cache.dtype in CACHE_DTYPES
        and fusable(attn.qkv_proj.packed, QKV_RUNS)
        and all(fusable(m.packed) for m in linears[1:])
        and all(m.bias is None and m.tp.size == 1 for m in linears)
    ):
        return None
    shape = LayerShape(
        attn.num_heads, attn.num_kv_heads, attn.head_dim, eps, attn.scale, attn.sliding_window
    )
    weights = tuple(m.packed for m in linears)
    return DecodeLayer(weights, norms, shape, attn.rotary.cos_sin_cache, kv_cache, gemma)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard index)
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # What a subclass of the same outline (embed, layers, norm, LM head) changes.
    embedding_class: type[VocabParallelEmbedding] = VocabParallelEmbedding
    norm_class: type[nn.Module] = RMSNorm
    rotary_class: type[RotaryEmbedding] = RotaryEmbedding
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = self.embedding_class(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layers(cfg))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = self.output_head(cfg)

    def output_head(self, cfg: ModelConfig) -> ParallelLMHead | None:
        """None for an embedding model: its output is the hidden states, pooled."""
        if cfg.pooling is not None:
            return None
        head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            head.weight = self.embed_tokens.weight
        return head

    def decoder_layers(self, cfg: ModelConfig) -> list[nn.Module]:
        """The layers, each `layer(positions, x, residual, kv_cache, meta) -> (x, residual)`."""
        # The table covers the context the config declares, which max_model_len never passes.
        rotary = self.rotary_class.from_config(cfg.raw, cfg.head_dim, cfg.max_position_embeddings)
        return [self.layer_class(cfg, rotary, window) for window in cfg.sliding_windows]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of every token in the flattened batch; `inputs_embeds`, where given,
        replace the tokens' embeddings (a vision-language model's, with its images in)."""
        self.cover_positions(meta.max_seq_len)  # M-RoPE's positions too stay below seq_len
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        fused = self._fused_decode(x, positions, kv_caches, meta)
        if fused is not None:
            x, residual = fused
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(positions, x, residual, kv_cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def cover_positions(self, reach: int) -> None:
        """Writes the rotary tables' rows of positions below `reach` (`RotaryEmbedding.cover`):
        before the layers run a step whose longest context is `reach`."""
        for rotary in self._rotaries:
            rotary.cover(reach)

    @functools.cached_property
    def _rotaries(self) -> list[RotaryEmbedding]:
        return [m for m in self.modules() if isinstance(m, RotaryEmbedding)]

    @functools.cached_property
    def _layer_formats(self) -> frozenset[Format]:
        """The block formats the layers' weights are held in (made on the first decode step,
        after loading)."""
        packed = (getattr(m, "packed", None) for m in self.layers.modules())
        return frozenset(f for p in packed if isinstance(p, QuantizedWeight) for f in p.formats)

    # The layers as decode_layer.c runs them ([] where it cannot: see `decode_layers`), made on
    # the first decode step, once the KV caches exist; and the key cache they were made with.
    _decode_layers: tuple[torch.Tensor, list[DecodeLayer]] | None = None

    def _fused_decode(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, residual) after every layer, each in one C call, on a step of one-token sequences
        (a few, or as many as there are where their products run in quant_gemm.c: see
        `decode_layer.takes`); None where the layers take their torch path."""
        if not (
            meta.max_query_len == 1
            and takes(x.shape[0], self._layer_formats)
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and positions.dim() == 1
            and kv_caches
        ):
            return None
        if self._decode_layers is None or self._decode_layers[0] is not kv_caches[0][0]:
            self._decode_layers = (kv_caches[0][0], decode_layers(self.layers, kv_caches))
        layers = self._decode_layers[1]
        if not layers:
            return None
        x = x.contiguous().clone()  # written in place: an embedding given may be kept elsewhere
        residual = torch.empty_like(x)
        steps: dict[int | None, DecodeStep | None] = {}
        for i, layer in enumerate(layers):
            window = layer.shape.sliding_window
            if window not in steps:
                steps[window] = DecodeStep.of(meta, positions, window)
            step = steps[window]
            assert step is not None  # a step of one-token sequences has decode rows
            run_layer(layer, step, x, residual, has_residual=i > 0)
        return x, residual

    def compute_logits(self, hidden: torch.Tensor, vocab: slice = EVERY_TOKEN) -> torch.Tensor:
        """Logits over the whole vocabulary, on every rank; over the ids in `vocab` alone where
        `slices_vocabulary`."""
        return self.lm_head.compute_logits(hidden, vocab)

    @property
    def slices_vocabulary(self) -> bool:
        return self.lm_head.slices_vocabulary

    @property
    def screen(self) -> QuantizedWeight | None:
        return self.lm_head.screen

    def parameter_for(self, name: str) -> tuple[str, int | None]:
        """The parameter that checkpoint tensor `name` (less its `model.` prefix) fills, and
        which part of it where it is fused (None: the whole)."""
        for part, (fused, index) in self._FUSED.items():
            if f".{part}." in name:
                return name.replace(part, fused), index
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Loads (name, tensor) pairs named as transformers names them; each parameter reads only
        this rank's slice (from a `CheckpointTensor`, only those bytes of the file)."""
        loads = ParameterLoads(self)
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name:
                continue
            name, shard = self.parameter_for(ckpt_name.removeprefix("model."))
            # A tied head's weight is the embedding's: the checkpoint may hold a copy.
            tied = self.lm_head is None or self.cfg.tie_word_embeddings
            if name == "lm_head.weight" and name not in loads and tied:
                continue
            loads.load(ckpt_name, name, tensor, shard)
        loads.check_complete()


class LlamaForSequenceClassification(LlamaForCausalLM):
    """The same decoder under a score head: one logit per label (`ModelConfig.labels`) where a
    language model has one per token. Transformers reads the head at a sequence's last token,
    which is where the engine samples a prompt's first token: a request's first logits row
    (`SamplingParams.scores`) is the sequence's label scores. Also Qwen2's and Mistral's."""

    def output_head(self, cfg: ModelConfig) -> ParallelLMHead:
        return ParallelLMHead(len(cfg.labels), cfg.hidden_size)  # never tied to the embedding

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        renamed = (("lm_head.weight" if n == "score.weight" else n, t) for n, t in weights)
        super().load_weights(renamed)

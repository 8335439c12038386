"""BERT (as sentence-transformers' encoders use it: all-MiniLM, bge, e5, ...) over a packed batch.

A step's sequences are concatenated without padding: every linear is one matmul over all the
step's tokens, and attention, bidirectional, runs per group of sequences of equal length (see
`encoder_attention`). There is
no KV cache: each sequence is encoded whole, in one step. Post-LN layers: attention, add, norm;
GELU MLP, add, norm. Every token has token type 0 (one segment), as an embedding request's do.

Q/K/V are fused into one matmul; the loader concatenates the checkpoint's separate tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedbatch.engine.config import ModelConfig
from pagedbatch.engine.worker.models.encoder_attention import Group, varlen_attention
from pagedbatch.engine.worker.models.weights import ParameterLoads
from pagedbatch.engine.worker.parallel_layers import (
    ColumnParallelLinear,
    Loaded,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)

# Checkpoint name fragment -> (our parameter's fragment, shard of a fused parameter). Longest
# first: "attention.output.dense" also ends in "output.dense".
_RENAMES = (
    ("attention.self.query", "qkv", 0),
    ("attention.self.key", "qkv", 1),
    ("attention.self.value", "qkv", 2),
    ("attention.output.dense", "attn_out", None),
    ("attention.output.LayerNorm", "attn_norm", None),
    ("intermediate.dense", "intermediate", None),
    ("output.dense", "output", None),
    ("output.LayerNorm", "output_norm", None),
)
# What a BertModel checkpoint may hold that embeddings do not use.
_UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


class LayerNorm(nn.LayerNorm):
    def __init__(self, size: int, eps: float):
        super().__init__(size, eps=eps)
        for param in (self.weight, self.bias):
            param.weight_loader = default_weight_loader


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float):
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.qkv = QKVParallelLinear(hidden, cfg.head_dim, cfg.num_heads, cfg.num_heads, True)
        self.num_heads = self.qkv.num_heads  # this rank's
        self.head_dim = cfg.head_dim
        self.attn_out = RowParallelLinear(hidden, hidden, True, "the attention output")
        self.attn_norm = LayerNorm(hidden, eps)
        self.intermediate = ColumnParallelLinear(hidden, [inter], True, "intermediate_size")
        self.output = RowParallelLinear(inter, hidden, True, "intermediate_size")
        self.output_norm = LayerNorm(hidden, eps)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, groups: list[Group]) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv(x).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        attn = varlen_attention(q, k, v, groups, self.scale)
        x = self.attn_norm(x + self.attn_out(attn.view(num_tokens, -1)))
        # The MLP's hidden activation, the widest, feeds the output matmul alone: it stays in the
        # dtype the matmuls take (bfloat16 under matmul_precision bfloat16: two passes fewer).
        hidden = F.gelu(self.intermediate(x.to(self.intermediate.input_dtype)))
        return self.output_norm(x + self.output(hidden))


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, eps: float):
        super().__init__()
        raw = cfg.raw
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(raw.get("type_vocab_size", 2), cfg.hidden_size)
        for table in (self.position_embeddings, self.token_type_embeddings):
            table.weight.weight_loader = default_weight_loader
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertModel(nn.Module):
    """Hidden states of every token of a packed batch of whole sequences."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only BERT's absolute position embeddings are supported")
        if cfg.raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {cfg.raw['hidden_act']!r} is not supported (gelu)")
        eps = cfg.raw.get("layer_norm_eps", 1e-12)
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg, eps)
        self.layers = nn.ModuleList(BertLayer(cfg, eps) for _ in range(cfg.num_layers))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, groups: list[Group]
    ) -> torch.Tensor:
        """`groups` lay out the sequences, equal lengths together (see `encoder_attention`);
        `positions` are each token's index in its sequence."""
        x = self.embeddings(input_ids, positions)
        for layer in self.layers:
            x = layer(x, groups)
        return x

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Loads (name, tensor) pairs named as transformers' BertModel names them (a "bert."
        prefix, as task models save them, is dropped)."""
        loads = ParameterLoads(self)
        for ckpt_name, tensor in weights:
            name = ckpt_name.removeprefix("bert.")
            if name.startswith(_UNUSED_PREFIXES):
                continue
            name, shard = _our_name(name)
            loads.load(ckpt_name, name, tensor, shard)
        loads.check_complete()


def _our_name(name: str) -> tuple[str, int | None]:
    """Our parameter's name for a checkpoint tensor's, and its shard of a fused parameter."""
    if not name.startswith("encoder.layer."):
        return name, None
    index, _, rest = name.removeprefix("encoder.layer.").partition(".")
    for fragment, ours, shard in _RENAMES:
        if rest.startswith(fragment + "."):
            return f"layers.{index}.{ours}{rest[len(fragment) :]}", shard
    return name, None

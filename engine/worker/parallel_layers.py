"""Layers split across the tensor-parallel ranks (Megatron-style), each loading only its slice.

- Column-parallel linears (Q/K/V, gate/up) split their output features: each rank computes its
  own heads or intermediate features, with no communication.
- Row-parallel linears (attention output, down) split their input features: each rank's partial
  product is summed over the ranks (all-reduce); the bias is added once, after the sum.
- The vocabulary-parallel embedding splits the vocabulary: each rank looks up the tokens it holds,
  zeros for the others, and the all-reduce completes every row. The LM head splits the same way
  and all-gathers the logits. The vocabulary is padded up to a multiple of the rank count; the
  padding rows are zero and their logits are cut off.

Each parameter carries a `weight_loader(param, loaded, shard)` that reads the rank's part of the
checkpoint tensor `loaded` by indexing it (`loaded[a:b]`, `loaded[:, a:b]`), which for a
`CheckpointTensor` reads only those bytes from the file. `shard` picks the part of a fused
parameter (q, k or v; gate or up). With one rank every layer is a plain linear or embedding.

A GGUF loaded with quantization gguf hands over a `QuantizedTensor` (its blocks) for each
tensor the quantized kernels read. With one rank, a linear keeps those blocks instead of filling
its weight, and `quantize_linears` turns them into its `QuantizedWeight` once the checkpoint is
read; the embedding keeps them too, dequantizing the rows of each step's tokens, and a tied LM
head computes on them. Everything else reads a `QuantizedTensor` as a float32 tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedbatch.engine.worker import distributed
from pagedbatch.engine.worker.distributed import divide
from pagedbatch.kernels.quant_linear import QuantizedTensor, QuantizedWeight

if TYPE_CHECKING:
    from pagedbatch.engine.lora.linear import LoraLinear

# A torch.Tensor or a CheckpointTensor: anything with `shape` that reads a slice when indexed.
Loaded = Any


def check_shape(loaded: Loaded, expected: Sequence[int]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded.shape)}, the model expects {tuple(expected)}")


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `Packed` applies: float32 weights on a CPU with oneDNN."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


class Packed:
    """A linear's weight reordered once into oneDNN's blocked layout, for matmuls of about
    `rows` rows (any count works). On CPU, in float32, oneDNN's matmul on it takes a decode step
    of SmolLM2-135M at 128 sequences from 470 to 403 ms against MKL's sgemm on the weight as
    loaded (F.linear), most on the wide projections (gate/up, the LM head). Its sums are
    ordered differently: results differ from F.linear's in the last bits."""

    def __init__(self, weight: torch.Tensor, rows: int):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")


class Bfloat16Weight:
    """A float32 linear's weight held in bfloat16, for `matmul_precision` bfloat16: the input is
    rounded to bfloat16 as well, and oneDNN multiplies on AMX or AVX512-BF16 and sums in float32;
    the product comes back as float32 (rounded to bfloat16 once on the way) and the bias is
    added in float32, so the activations between the linears stay float32. An input given in
    bfloat16 (one that feeds this matmul alone: see `ColumnParallelLinear.input_dtype`) gets
    its output in bfloat16, the bias added before the rounding. On one core of a Xeon
    with AMX, a MiniLM (all-MiniLM-L6-v2) embedding step ran 2.2x as fast as in float32, and its
    embeddings stayed within cosine 0.99995 of float32's. F.linear on bfloat16 tensors, unlike a
    packed weight's oneDNN call, lets the GIL go: an encoder's shard threads keep their cores."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach().to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == torch.bfloat16:  # an activation that goes to a matmul only, kept so
            return F.linear(x, self.weight, None if bias is None else bias.to(x.dtype))
        out = F.linear(x.to(torch.bfloat16), self.weight).float()
        return out if bias is None else out.add_(bias)

    def output_rows(self, part: slice) -> Bfloat16Weight:
        """The weight of the outputs `part` selects, a view."""
        sliced = copy.copy(self)
        sliced.weight = self.weight[part]
        return sliced


PackedWeight = Packed | Bfloat16Weight | QuantizedWeight
EVERY_TOKEN = slice(None)  # the whole vocabulary, for `ParallelLMHead.compute_logits`


def pack_weights(model: nn.Module, rows: int) -> None:
    """Packs every linear of `model`, once its weights are loaded (see `Packed`)."""
    _repack(model, lambda weight: Packed(weight, rows) if can_pack(weight) else None)


def bfloat16_weights(model: nn.Module) -> None:
    """Holds every linear's weight of `model` in bfloat16, once they are loaded (see
    `Bfloat16Weight`)."""
    _repack(model, Bfloat16Weight)


def _repack(model: nn.Module, pack: Callable[[torch.Tensor], PackedWeight | None]) -> None:
    """Each linear's weight packed by `pack`, the loaded one emptied where that applies, so that
    the model holds its weights once. The LM head's weight stays: a tied head shares it with the
    embedding. A linear that computes on its quantized blocks keeps them."""
    for module in model.modules():
        if isinstance(getattr(module, "packed", None), QuantizedWeight):
            continue
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            module.packed = pack(module.weight)
            if module.packed is not None:
                module.weight.data = module.weight.data.new_empty(0)
        elif isinstance(module, ParallelLMHead):
            module.packed = pack(module.weight)


def quantize_linears(model: nn.Module) -> tuple[int, int]:
    """Each linear whose checkpoint tensors all came as blocks computes on them
    (`QuantizedWeight`, a run of blocks per format) and its float weight is emptied; one with a
    part that did not has the others dequantized into its weight beside it. The LM head takes
    its own blocks, or a tied embedding's (an embedding looks its rows up in its blocks
    already). Returns how many linears are quantized and the bytes their blocks hold."""
    embeddings = [
        m
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    ]
    tied = {id(m.weight): m.quantized for m in embeddings if m.quantized is not None}
    count = nbytes = 0
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            weight = module.take_quantized()
        elif isinstance(module, ParallelLMHead):
            own, module.quantized = module.quantized, None  # a head looks nothing up
            source = own or tied.get(id(module.weight))
            weight = QuantizedWeight.join([source]) if source is not None else None
        else:
            continue
        if weight is not None:
            module.packed = weight
            count, nbytes = count + 1, nbytes + weight.nbytes
    return count, nbytes


def default_weight_loader(param: nn.Parameter, loaded: Loaded, shard: int | None = None) -> None:
    """A parameter every rank holds whole (norm weights, a row-parallel bias)."""
    check_shape(loaded, param.shape)
    param.data.copy_(loaded[:])


class ColumnParallelLinear(nn.Module):
    """A linear whose output is the concatenation of `output_sizes` parts (one part, or a fused
    projection such as gate/up); each rank holds the same 1/size slice of every part."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, what: str):
        super().__init__()
        self.tp = distributed.current()
        self.input_size = input_size
        self.full_sizes = list(output_sizes)
        self.sizes = [divide(s, self.tp.size, what) for s in output_sizes]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), input_size))
        self.weight.weight_loader = self.weight_loader
        self.packed: PackedWeight | None = None
        # Parts given as blocks, by index, until `take_quantized` (see the module's docstring).
        self.quantized_parts: dict[int, QuantizedTensor] = {}
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.sizes)))
            self.bias.weight_loader = self.weight_loader
        self.lora: LoraLinear | None = None  # the served adapters' deltas (engine/lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _linear(x, self.weight, self.packed, self.bias)
        return out if self.lora is None else self.lora.add(x, out)

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype its matmul takes its input in: given in it, the output comes back in it
        too, which suits an activation that only feeds another matmul (an MLP's hidden one)."""
        return torch.bfloat16 if isinstance(self.packed, Bfloat16Weight) else self.weight.dtype

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard: int | None = None) -> None:
        index = shard or 0
        expected = [self.full_sizes[index]] + ([self.input_size] if param.dim() == 2 else [])
        check_shape(loaded, expected)
        if _keeps_blocks(self, param, loaded):
            self.quantized_parts[index] = loaded.to(param.device)
            return
        size = self.sizes[index]
        start = self.tp.rank * size
        param.data.narrow(0, self.offsets[index], size).copy_(loaded[start : start + size])

    def take_quantized(self) -> QuantizedWeight | None:
        """The weight from the parts kept as blocks, its float weight emptied; None where some
        part was not (those kept are then dequantized into the weight)."""
        parts, self.quantized_parts = self.quantized_parts, {}
        joined = None
        if len(parts) == len(self.sizes):
            joined = QuantizedWeight.join([parts[i] for i in range(len(self.sizes))])
        if joined is not None:
            self.weight.data = self.weight.data.new_empty(0)
            return joined
        for index, part in parts.items():
            self.weight.data.narrow(0, self.offsets[index], self.sizes[index]).copy_(part[:])
        return None


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V fused; each rank holds whole heads: its share of the query heads and of the
    key/value heads (so the KV cache of a rank holds its key/value heads only)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ):
        size = distributed.current().size
        divide(num_heads, size, "num_attention_heads")
        divide(num_kv_heads, size, "num_key_value_heads")
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q, kv, kv], bias, "the q/k/v projection")
        self.num_heads = num_heads // size
        self.num_kv_heads = num_kv_heads // size


class RowParallelLinear(nn.Module):
    """A linear whose input features are split across the ranks; outputs are summed over them."""

    def __init__(self, input_size: int, output_size: int, bias: bool, what: str):
        super().__init__()
        self.tp = distributed.current()
        self.full_input_size = input_size
        self.input_size = divide(input_size, self.tp.size, what)
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size))
        self.weight.weight_loader = self.weight_loader
        self.packed: PackedWeight | None = None
        self.quantized: QuantizedTensor | None = None  # until `take_quantized`
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = default_weight_loader
        self.lora: LoraLinear | None = None  # one rank's only (engine/lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            out = _linear(x, self.weight, self.packed, self.bias)
            return out if self.lora is None else self.lora.add(x, out)
        out = self.tp.all_reduce(_linear(x, self.weight, self.packed))
        return out if self.bias is None else out + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard: int | None = None) -> None:
        check_shape(loaded, (param.shape[0], self.full_input_size))
        if _keeps_blocks(self, param, loaded):
            self.quantized = loaded.to(param.device)
            return
        start = self.tp.rank * self.input_size
        param.data.copy_(loaded[:, start : start + self.input_size])

    def take_quantized(self) -> QuantizedWeight | None:
        """The weight from the blocks kept, its float weight emptied; None without them."""
        kept, self.quantized = self.quantized, None
        if kept is None:
            return None
        self.weight.data = self.weight.data.new_empty(0)
        return QuantizedWeight.join([kept])


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split across the ranks in contiguous ranges."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = distributed.current()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.rows = -(-vocab_size // self.tp.size)  # the last rank's range may end in padding
        self.start = self.tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
        self.weight.weight_loader = self.weight_loader
        # The blocks it was loaded from, in place of its weight: its lookups and an LM head (its
        # own, or one tied to it) read them.
        self.quantized: QuantizedTensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:  # one rank (see weight_loader)
            return self.quantized.take_rows(input_ids).to(self.weight.dtype)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        held = (local >= 0) & (local < self.rows)
        out = F.embedding(local.where(held, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(~held.unsqueeze(-1), 0))

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard: int | None = None) -> None:
        check_shape(loaded, (self.vocab_size, self.hidden_size))
        if _keeps_blocks(self, param, loaded):
            self.quantized = loaded.to(param.device)
            param.data = param.data.new_empty(0)  # a tied head's too: it computes on the blocks
            return
        real = max(0, min(self.rows, self.vocab_size - self.start))
        param.data[:real].copy_(loaded[self.start : self.start + real])
        param.data[real:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection onto the vocabulary, split as the embedding is."""

    packed: PackedWeight | None = None

    @property
    def slices_vocabulary(self) -> bool:
        """Whether `compute_logits` takes a part of the vocabulary: with one rank, on a weight
        whose rows can be cut (not one in oneDNN's blocked layout)."""
        return self.tp.size == 1 and not isinstance(self.packed, Packed)

    @property
    def screen(self) -> QuantizedWeight | None:
        """The weight whose approximate product greedy steps may screen tokens with
        (`engine/sample/greedy.py`): a quantized one, where the vocabulary is sliced."""
        packed = self.packed
        return packed if self.slices_vocabulary and isinstance(packed, QuantizedWeight) else None

    def compute_logits(self, hidden: torch.Tensor, vocab: slice = EVERY_TOKEN) -> torch.Tensor:
        """Logits of the token ids in `vocab`, all by default; a part only where
        `slices_vocabulary`."""
        if vocab != EVERY_TOKEN:
            packed = None if self.packed is None else self.packed.output_rows(vocab)
            return _linear(hidden, self.weight[vocab], packed)
        logits = _linear(hidden, self.weight, self.packed)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[..., : self.vocab_size]


def _keeps_blocks(module: nn.Module, param: nn.Parameter, loaded: Loaded) -> bool:
    """Whether `module` keeps `loaded`'s blocks for its weight: with one rank only (a rank's
    slice of the blocks is future work)."""
    return isinstance(loaded, QuantizedTensor) and param is module.weight and module.tp.size == 1


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: PackedWeight | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, on the packed weight where there is one."""
    return packed(x, bias) if packed is not None else F.linear(x, weight, bias)

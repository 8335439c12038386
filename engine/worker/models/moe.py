"""A mixture-of-experts MLP (Mixtral's, Qwen3-MoE's): a router picks each token's top-k experts,
each a gated MLP (gate and up, SiLU, down), and the token's output is their outputs weighted by
the router's probabilities.

The experts' weights are 3-D parameters, `w13` `[experts, 2 * intermediate, hidden]` (each
expert's gate rows then its up rows) and `w2` `[experts, hidden, intermediate]`, loaded from the
checkpoint's per-expert tensors. Computed as a grouped matmul (`ops.fused_experts`): the step's
(token, expert) pairs sorted by expert, one matmul per expert touched on CPU; on GPU, one
Triton launch for every expert's gate/up and one for their down.

Tensor-parallel as the dense MLP is: every rank holds every expert's slice of the intermediate
features (its rows of gate and up, its columns of down) and the whole router; each rank's partial
sums are all-reduced.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from pagedbatch.engine.worker import distributed
from pagedbatch.engine.worker.distributed import divide
from pagedbatch.engine.worker.parallel_layers import Loaded, check_shape
from pagedbatch.kernels import ops

_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>\w+)\.weight$")


class Experts(nn.Module):
    """`num_experts` gated MLPs, this rank's slice of each."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.tp = distributed.current()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = divide(
            intermediate_size, self.tp.size, "the experts' intermediate size"
        )
        inter = self.intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.w13.weight_loader = self._load_w13
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        self.w2.weight_loader = self._load_w2

    def parts_of(self, name: str) -> int:
        """Parts each parameter loads in (see `weights.ParameterLoads`): an expert's gate and
        up for `w13`, its down for `w2`."""
        return 2 * self.num_experts if name == "w13" else self.num_experts

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x `[tokens, hidden]`; each token's experts `topk_ids` `[tokens, k]` and their
        weights. Returns this rank's part of the weighted sum `[tokens, hidden]`."""
        return ops.fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)

    def _expert(self, index: int) -> int:
        if not 0 <= index < self.num_experts:
            raise ValueError(f"names expert {index}; the model has {self.num_experts}")
        return index

    def _load_w13(self, param: nn.Parameter, loaded: Loaded, shard: int | None = None) -> None:
        expert, part = divmod(shard or 0, 2)
        expert = self._expert(expert)
        check_shape(loaded, (self.full_intermediate_size, self.hidden_size))
        size = self.intermediate_size
        start = self.tp.rank * size
        param.data[expert, part * size : (part + 1) * size].copy_(loaded[start : start + size])

    def _load_w2(self, param: nn.Parameter, loaded: Loaded, shard: int | None = None) -> None:
        expert = self._expert(shard or 0)
        check_shape(loaded, (self.hidden_size, self.full_intermediate_size))
        start = self.tp.rank * self.intermediate_size
        param.data[expert].copy_(loaded[:, start : start + self.intermediate_size])


class SparseMoeBlock(nn.Module):
    """The router (`gate`, whole on every rank) and the experts. `renormalize`: the top-k
    probabilities scaled to sum to 1 (Mixtral's, Qwen3-MoE's `norm_topk_prob`);
    `weights_in_input_dtype`: rounded to the activations' dtype before they scale the experts'
    outputs (Qwen3-MoE), rather than kept in float32 (Mixtral)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        weights_in_input_dtype: bool,
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts}, got {top_k}")
        self.tp = distributed.current()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_input_dtype = weights_in_input_dtype
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_input_dtype:
            weights = weights.to(x.dtype)
        out = self.experts(x, weights, ids)
        return out if self.tp.size == 1 else self.tp.all_reduce(out)


def expert_parameter(name: str, projections: Sequence[str]) -> tuple[str, int] | None:
    """The experts' parameter and part that checkpoint tensor `name` fills, where it is one
    expert's projection: `projections` are the checkpoint's names of gate, up and down (Mixtral's
    w1, w3, w2). None for any other tensor."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["proj"] not in projections:
        return None
    index, which = int(match["index"]), projections.index(match["proj"])
    if which == 2:
        return f"{match['experts']}.w2", index
    return f"{match['experts']}.w13", 2 * index + which

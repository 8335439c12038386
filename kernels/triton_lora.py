"""LoRA deltas as Triton kernels: the CUDA path beside `lora.py`, same signature.

Two launches a linear, as Punica's segmented kernels (and vLLM's after them) do: shrink,
`t = scaling_s * x @ A_s^T` (`r` columns a row), then expand, `out += t @ B_s^T`. The rows come
grouped by adapter slot (see `lora.py`), and the launch grid has an axis over the groups: a
program takes one block of one group's rows, so that one adapter's A or B tile serves all its
rows, and exits at once where its group has fewer rows than the widest (the grid is sized by
the widest group, which the host knows without reading the device). Base-model rows are in no
group and cost nothing. `t` stays in float32 between the two; each row of `out` belongs to one
group, so the expand adds without atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_M = 16
_BLOCK_N = 64
_BLOCK_K = 32


@triton.jit
def _group_rows(rows, starts, counts, group, m_block, BLOCK_M: tl.constexpr):
    """This program's positions in `rows` (the group's rows in order), which of them are real,
    and the step rows they name."""
    count = tl.load(counts + group)
    offsets = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    real = offsets < count
    positions = tl.load(starts + group) + offsets
    step_rows = tl.load(rows + positions, mask=real, other=0).to(tl.int64)
    return positions, real, step_rows


@triton.jit
def _shrink_kernel(
    x,
    a,
    t,
    rows,
    starts,
    counts,
    slots,
    scalings,
    k,
    r,
    stride_x,
    stride_a_slot,
    stride_a_rank,
    stride_t,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """t[p] = scaling_s * x[rows[p]] @ A_s^T for this program's positions p of group g."""
    m_block = tl.program_id(0)
    group = tl.program_id(1)
    if m_block * BLOCK_M >= tl.load(counts + group):
        return
    positions, real, step_rows = _group_rows(rows, starts, counts, group, m_block, BLOCK_M)
    slot = tl.load(slots + group).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < r
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x_tile = tl.load(
            x + step_rows[:, None] * stride_x + ks[None, :],
            mask=real[:, None] & k_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        a_tile = tl.load(
            a + slot * stride_a_slot + ranks[None, :] * stride_a_rank + ks[:, None],
            mask=rank_ok[None, :] & k_ok[:, None],
            other=0.0,
        ).to(DOT_DTYPE)
        # float32 products in float32 (not TF32): the torch path's precision.
        acc = tl.dot(x_tile, a_tile, acc, input_precision="ieee")
    scaling = tl.load(scalings + slot).to(tl.float32)
    tl.store(
        t + positions[:, None] * stride_t + ranks[None, :],
        acc * scaling,
        mask=real[:, None] & rank_ok[None, :],
    )


@triton.jit
def _expand_kernel(
    t,
    b,
    out,
    rows,
    starts,
    counts,
    slots,
    n,
    r,
    stride_t,
    stride_b_slot,
    stride_b_out,
    stride_b_rank,
    stride_out,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """out[rows[p], cols] += t[p] @ B_s[cols]^T for this program's positions p of group g."""
    m_block = tl.program_id(0)
    group = tl.program_id(2)
    if m_block * BLOCK_M >= tl.load(counts + group):
        return
    positions, real, step_rows = _group_rows(rows, starts, counts, group, m_block, BLOCK_M)
    slot = tl.load(slots + group).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < r
    t_tile = tl.load(
        t + positions[:, None] * stride_t + ranks[None, :],
        mask=real[:, None] & rank_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    b_tile = tl.load(
        b + slot * stride_b_slot + cols[None, :] * stride_b_out + ranks[:, None] * stride_b_rank,
        mask=col_ok[None, :] & rank_ok[:, None],
        other=0.0,
    ).to(DOT_DTYPE)
    delta = tl.dot(t_tile, b_tile, input_precision="ieee")
    where = out + step_rows[:, None] * stride_out + cols[None, :]
    mask = real[:, None] & col_ok[None, :]
    base = tl.load(where, mask=mask, other=0.0)
    # As the torch path adds: the delta rounded to out's dtype, then the sum in it.
    delta = delta.to(out.dtype.element_ty).to(tl.float32)
    tl.store(where, (base.to(tl.float32) + delta).to(out.dtype.element_ty), mask=mask)


def _dot_dtype(a: torch.Tensor) -> tl.dtype:
    """Half-precision operands feed the tensor cores; on a CPU tensor (Triton's interpreter,
    which computes bfloat16 dots wrongly) every dot runs in float32."""
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        return tl.float16 if a.dtype == torch.float16 else tl.bfloat16
    return tl.float32


# The last step's group layout: `valid` is made anew each step (by `LoraMapping.of`) and read by
# every adapted linear of it, so the layout is worked out by the first and kept for the rest.
# Holding `valid` keeps its id from being reused by another tensor while it is compared.
_last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _groups(valid: torch.Tensor, width: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each group's rows start in `rows`, and how many it has; from the device's tensors,
    without waiting on it."""
    global _last
    if _last is not None and _last[0] is valid:
        return _last[1], _last[2]
    counts = torch.zeros(groups, dtype=torch.int32, device=valid.device)
    counts.index_add_(0, valid // width, torch.ones_like(valid, dtype=torch.int32))
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    _last = (valid, starts, counts)
    return starts, counts


def add_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scalings: torch.Tensor,
    gather: torch.Tensor,
    valid: torch.Tensor,
    rows: torch.Tensor,
    width: int,
    subset: torch.Tensor | None,
) -> torch.Tensor:
    """As `lora.add_lora`: `out` with each grouped row's adapter delta added, in place."""
    num_groups = gather.numel() // width if width else 0
    if num_groups == 0 or rows.numel() == 0:
        return out
    x, a = x.contiguous(), a.contiguous()  # b in any layout: LoraLinear keeps it rank-major
    target = out if out.is_contiguous() else out.contiguous()
    starts, counts = _groups(valid, width, num_groups)
    slots = torch.arange(num_groups, device=x.device) if subset is None else subset
    scalings = scalings.reshape(-1)
    r, k, n = a.shape[1], a.shape[2], b.shape[1]
    block_r = max(16, triton.next_power_of_2(r))  # tl.dot takes tiles of 16 and more
    t = torch.empty(rows.numel(), r, dtype=torch.float32, device=x.device)
    m_blocks = triton.cdiv(width, _BLOCK_M)
    _shrink_kernel[(m_blocks, num_groups)](
        x,
        a,
        t,
        rows,
        starts,
        counts,
        slots,
        scalings,
        k,
        r,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        t.stride(0),
        DOT_DTYPE=_dot_dtype(a),
        BLOCK_M=_BLOCK_M,
        BLOCK_R=block_r,
        BLOCK_K=_BLOCK_K,
    )
    _expand_kernel[(m_blocks, triton.cdiv(n, _BLOCK_N), num_groups)](
        t,
        b,
        target,
        rows,
        starts,
        counts,
        slots,
        n,
        r,
        t.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        target.stride(0),
        DOT_DTYPE=_dot_dtype(b),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_R=block_r,
    )
    return out if target is out else out.copy_(target)

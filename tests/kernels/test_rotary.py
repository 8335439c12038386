"""The rotary kernel against transformers' apply_rotary_pos_emb, on the C kernel (float32 on the
CPU) and on torch alike."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pagedbatch.kernels.rotary import apply_rotary_embedding

pytestmark = pytest.mark.usefixtures("native_path")

HEAD_DIM = 64
NUM_HEADS, NUM_KV_HEADS = 6, 2


def cos_sin_table(num_positions: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin ([positions, D], each half repeated) and our packed table."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM))
    freqs = torch.arange(num_positions).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    half = HEAD_DIM // 2
    return (cos, sin), torch.cat((cos[:, :half], sin[:, :half]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scaling", [1.0, 1.1386])
def test_matches_transformers_bitwise(dtype, scaling):
    (cos, sin), table = cos_sin_table(300, scaling)
    positions = torch.tensor([0, 1, 5, 299, 17, 17, 128])
    gen = torch.Generator().manual_seed(0)
    # Strided views of one fused QKV projection, as the model hands them over.
    qkv = torch.randn(7, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(7, NUM_HEADS, HEAD_DIM)
    k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(
        7, NUM_KV_HEADS, -1
    )
    before = qkv.clone()

    out_q, out_k = apply_rotary_embedding(positions, q, k, table)

    expected_q, expected_k = apply_rotary_pos_emb(
        q, k, cos[positions].to(dtype), sin[positions].to(dtype), unsqueeze_dim=1
    )
    assert out_q.dtype == out_k.dtype == dtype
    torch.testing.assert_close(out_q, expected_q, atol=0, rtol=0)
    torch.testing.assert_close(out_k, expected_k, atol=0, rtol=0)
    assert torch.equal(qkv, before), "the inputs are left as they were"


@pytest.mark.parametrize("num_tokens", [1, 3, 700], ids=lambda n: f"{n}-tokens")
def test_many_tokens_match_one_at_a_time(num_tokens):
    # 700 tokens take the kernel's threaded loop; every row must still be its own.
    _, table = cos_sin_table(1024, 1.0)
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 1024, (num_tokens,), generator=gen)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    out_q, out_k = apply_rotary_embedding(positions, q, k, table)
    for t in (0, num_tokens // 2, num_tokens - 1):
        one_q, one_k = apply_rotary_embedding(
            positions[t : t + 1], q[t : t + 1], k[t : t + 1], table
        )
        assert torch.equal(out_q[t : t + 1], one_q) and torch.equal(out_k[t : t + 1], one_k)


def test_a_position_past_the_table_is_refused():
    _, table = cos_sin_table(16, 1.0)
    q, k = torch.zeros(2, NUM_HEADS, HEAD_DIM), torch.zeros(2, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(IndexError):
        apply_rotary_embedding(torch.tensor([3, 16]), q, k, table)


def test_positions_that_do_not_match_the_tokens_are_refused():
    _, table = cos_sin_table(16, 1.0)
    q, k = torch.zeros(2, NUM_HEADS, HEAD_DIM), torch.zeros(2, NUM_KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError):
        apply_rotary_embedding(torch.tensor([0, 1, 2]), q, k, table)

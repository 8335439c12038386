"""The Triton rotary kernel against the torch one (the reference), on the tables the RoPE types
build."""

from __future__ import annotations

import pytest
import torch

from pagedbatch.engine.worker.models.rope import RotaryEmbedding
from pagedbatch.kernels import rotary, triton_rotary

HEAD_DIM = 64
NUM_HEADS, NUM_KV_HEADS = 6, 2
ROPE_SCALING = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    # its attention scaling multiplies the table
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
}
# The interpreter rounds float32 to bfloat16 by truncation where GPUs (and torch) round to
# nearest: an ulp at each rounding, and x1 * cos - x2 * sin may cancel down to that error.
BFLOAT16_TOLERANCE = dict(rtol=2**-6, atol=2**-4)


def qk(device: str, num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided views of one fused QKV projection, as the model hands them over."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen)
    qkv = qkv.to(dtype).to(device)
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(num_tokens, NUM_HEADS, HEAD_DIM)
    k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM]
    return q, k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scaling", ROPE_SCALING)
def test_matches_the_torch_kernel(scaling, dtype, device):
    config = {"max_position_embeddings": 2048, "rope_scaling": ROPE_SCALING[scaling]}
    embedding = RotaryEmbedding.from_config(config, HEAD_DIM)
    embedding.cover(2048)  # rows are written as steps reach them
    table = embedding.cos_sin_cache.to(device)
    positions = torch.tensor([0, 1, 5, 2047, 17, 17, 128], device=device)
    q, k = qk(device, positions.numel(), dtype)
    before = q.clone(), k.clone()

    out_q, out_k = triton_rotary.apply_rotary_embedding(positions, q, k, table)
    expected_q, expected_k = rotary.apply_rotary_embedding(positions, q, k, table)

    assert out_q.dtype == out_k.dtype == dtype
    # Each product is rounded where torch rounds it: float32 and float16 agree bit for bit.
    tolerance = BFLOAT16_TOLERANCE if dtype == torch.bfloat16 else dict(atol=0, rtol=0)
    torch.testing.assert_close(out_q, expected_q, **tolerance)
    torch.testing.assert_close(out_k, expected_k, **tolerance)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1]), "the inputs are left alone"


def test_a_per_token_table(device):
    """Dynamic NTK hands over one fresh row per token, indexed by arange."""
    q, k = qk(device, 3, torch.float32)
    table = torch.randn(3, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(device)
    positions = torch.arange(3, device=device)
    out = triton_rotary.apply_rotary_embedding(positions, q, k, table)
    expected = rotary.apply_rotary_embedding(positions, q, k, table)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)

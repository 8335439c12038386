"""RotaryEmbedding against transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb, built from
the same config.json contents, for every supported RoPE type: equal to the bit in float32."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedbatch.engine.worker.models.rope import FILL_ROWS, RotaryEmbedding, rope_parameters

HEAD_DIM = 64
NUM_HEADS, NUM_KV_HEADS = 4, 2
BASE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": NUM_HEADS * HEAD_DIM,
    "num_attention_heads": NUM_HEADS,
    "num_key_value_heads": NUM_KV_HEADS,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "vocab_size": 32,
    "max_position_embeddings": 256,
}

# config.json contents, in both the transformers 5 and the older spelling
CONFIGS = {
    "default": {"rope_theta": 10000.0},
    "default_theta_omitted": {},
    "default_v5": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "linear": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "linear_legacy_type_key": {
        "rope_theta": 5000.0,
        "rope_scaling": {"type": "linear", "factor": 3},
    },
    "dynamic": {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "llama3": {
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    },
    "yarn": {
        "max_position_embeddings": 1024,
        "rope_theta": 1000000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    },
    "yarn_mscale": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
            "beta_slow": 2,
        },
    },
    "yarn_attention_factor_untruncated": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 1.25,
            "truncate": False,
        },
    },
}


def configs(name: str) -> tuple[dict, LlamaConfig]:
    raw = {**BASE, **CONFIGS[name]}
    return raw, LlamaConfig.from_dict(raw)


def hf_rotate(
    rotary: LlamaRotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One transformers forward over a single sequence; q/k are [T, heads, D]."""
    cos, sin = rotary(q, positions[None])
    q_embed, k_embed = apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)
    return q_embed[0], k_embed[0]


def random_qk(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return q, k


@pytest.mark.parametrize("name", [n for n in CONFIGS if not n.startswith("dynamic")])
def test_matches_transformers_across_the_positions(name):
    raw, hf_config = configs(name)
    ours = RotaryEmbedding.from_config(raw, HEAD_DIM)
    positions = torch.arange(ours.cos_sin_cache.shape[0])
    ours.cover(positions.numel())
    q, k = random_qk(positions.numel())
    expected_q, expected_k = hf_rotate(LlamaRotaryEmbedding(hf_config), positions, q, k)
    # In a shuffled order and in a batch with other tokens, rows still get their own positions.
    order = torch.randperm(positions.numel(), generator=torch.Generator().manual_seed(1))
    out_q, out_k = ours(positions[order], q[order], k[order])
    torch.testing.assert_close(out_q, expected_q[order], atol=0, rtol=0)
    torch.testing.assert_close(out_k, expected_k[order], atol=0, rtol=0)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("default", 256), ("linear", 512), ("dynamic", 256), ("llama3", 1024), ("yarn", 1024)],
)
def test_table_reaches_the_context_the_type_extends_to(name, expected):
    raw, _ = configs(name)
    assert RotaryEmbedding.from_config(raw, HEAD_DIM).cos_sin_cache.shape == (expected, HEAD_DIM)
    assert (
        RotaryEmbedding.from_config(raw, HEAD_DIM, max_positions=100).cos_sin_cache.shape[0] == 100
    )


@pytest.mark.parametrize("head_dim", [64, 80, 256])
def test_table_written_as_steps_reach_it_equals_the_table_written_at_once(head_dim):
    """Rows are written only as far as the longest context so far (a 32k-position table of a
    chat is mostly never touched, so never resident), whole chunks at a time, each row as
    the whole table computed at once has it."""
    raw = {**BASE, "max_position_embeddings": 4 * FILL_ROWS + 100}
    rotary = RotaryEmbedding.from_config(raw, head_dim)
    assert rotary.covered == 0
    for reach, covered in [(1, FILL_ROWS), (FILL_ROWS, FILL_ROWS), (FILL_ROWS + 1, 2 * FILL_ROWS)]:
        rotary.cover(reach)
        assert rotary.covered == covered
    rotary.cover(10**6)
    assert rotary.covered == 4 * FILL_ROWS + 100
    whole = RotaryEmbedding.from_config(raw, head_dim)
    whole.cover(whole.cos_sin_cache.shape[0])
    assert torch.equal(rotary.cos_sin_cache, whole.cos_sin_cache)
    inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(4 * FILL_ROWS + 100)[:, None].float() * inv_freq
    torch.testing.assert_close(rotary.cos_sin_cache, torch.cat((freqs.cos(), freqs.sin()), -1))


def test_old_and_new_config_spellings_agree():
    old = {**BASE, "rope_theta": 20000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    new = {**BASE, "rope_parameters": {"rope_type": "linear", "rope_theta": 20000.0, "factor": 2.0}}
    assert rope_parameters(old) == {**rope_parameters(new), "type": "linear"}
    old_rotary, new_rotary = (RotaryEmbedding.from_config(c, HEAD_DIM) for c in (old, new))
    for rotary in (old_rotary, new_rotary):
        rotary.cover(rotary.cos_sin_cache.shape[0])
    assert torch.equal(old_rotary.cos_sin_cache, new_rotary.cos_sin_cache)


def test_unsupported_rope_type_is_refused():
    raw = {**BASE, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 32}}
    with pytest.raises(ValueError, match="longrope"):
        RotaryEmbedding.from_config(raw, HEAD_DIM)


@pytest.mark.parametrize("prompt_len", [100, 300])
def test_dynamic_ntk_matches_transformers_generating_token_by_token(prompt_len):
    """A prompt in one forward, then one token per forward, past the original 256 positions:
    transformers recomputes its frequencies as the sequence grows; each step must match."""
    raw, hf_config = configs("dynamic")
    ours = RotaryEmbedding.from_config(raw, HEAD_DIM)
    hf = LlamaRotaryEmbedding(hf_config)
    steps = [torch.arange(prompt_len)] + [torch.tensor([p]) for p in range(prompt_len, 320)]
    for step, positions in enumerate(steps):
        q, k = random_qk(positions.numel(), seed=step)
        expected_q, expected_k = hf_rotate(hf, positions, q, k)
        seq_lens = torch.full_like(positions, int(positions[-1]) + 1)
        ours.cover(int(positions[-1]) + 1)  # as the model runner does before each step
        out_q, out_k = ours(positions, q, k, seq_lens)
        torch.testing.assert_close(out_q, expected_q, atol=0, rtol=0)
        torch.testing.assert_close(out_k, expected_k, atol=0, rtol=0)


def test_dynamic_ntk_scales_each_sequence_of_a_batch_by_its_own_length():
    raw, hf_config = configs("dynamic")
    ours = RotaryEmbedding.from_config(raw, HEAD_DIM)
    short, long = torch.arange(200, 203), torch.arange(290, 300)
    q, k = random_qk(short.numel() + long.numel())
    seq_lens = torch.tensor([203] * short.numel() + [300] * long.numel())
    ours.cover(300)
    out_q, out_k = ours(torch.cat([short, long]), q, k, seq_lens)
    for rows, positions in [(slice(0, 3), short), (slice(3, None), long)]:
        # A fresh transformers module per sequence: its state then follows that sequence only.
        expected_q, expected_k = hf_rotate(
            LlamaRotaryEmbedding(hf_config), positions, q[rows], k[rows]
        )
        torch.testing.assert_close(out_q[rows], expected_q, atol=0, rtol=0)
        torch.testing.assert_close(out_k[rows], expected_k, atol=0, rtol=0)

"""The Triton LoRA kernels (shrink x·A, expand ·B, per row's adapter) against the torch path
(the reference), and both against each row's delta worked out alone in float64; then the engine
end to end on the Triton kernels with adapters, against transformers + peft."""

from __future__ import annotations

import pytest
import torch
from lora_adapters import ATTENTION, MLP, make_adapter, peft_greedy

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.lora.mapping import BASE, LoraMapping
from pagedbatch.kernels import lora, ops, triton_lora

# float32 in IEEE precision sums in another order than MKL's; in bfloat16 the torch path rounds
# x·A to bfloat16 where the kernels keep it in float32 (and the interpreter truncates where GPUs
# round to nearest).
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-6, atol=2**-5),
}


def stacked(
    ranks: list[int], max_rank: int, parts: list[int], input_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A and B of one linear as the engine stacks them (`engine.lora.linear.LoraLinear`): slot s
    an adapter of rank `ranks[s]` padded with zeros to `max_rank`, each of the `parts` outputs'
    B in its own block (a fused linear's block diagonal); scalings `[slots, 1, 1]`."""
    gen = torch.Generator().manual_seed(seed)
    slots = len(ranks)
    a = torch.zeros(slots, len(parts) * max_rank, input_size)
    b = torch.zeros(slots, sum(parts), len(parts) * max_rank)
    for slot, r in enumerate(ranks):
        offset = 0
        for i, size in enumerate(parts):
            at = i * max_rank
            a[slot, at : at + r] = torch.randn(r, input_size, generator=gen) / input_size**0.5
            b[slot, offset : offset + size, at : at + r] = torch.randn(size, r, generator=gen)
            offset += size
    scalings = (torch.rand(slots, generator=gen) + 0.5).view(-1, 1, 1)
    return a, b, scalings


def per_row(x, out, a, b, scalings, row_slots) -> torch.Tensor:
    """Each row's delta alone, in float64: the arithmetic both paths must agree with."""
    expected = out.double().clone()
    for row, slot in enumerate(row_slots):
        if slot != BASE:
            shrunk = x[row].double() @ a[slot].double().T
            expected[row] += scalings[slot].double().item() * (shrunk @ b[slot].double().T)
    return expected


def sequence_slots(slots: list[int], lengths: list[int]) -> tuple[list[int], list[int]]:
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    per_row_slots = [s for s, n in zip(slots, lengths, strict=True) for _ in range(n)]
    return starts, per_row_slots


CASES = {
    # name: (ranks by slot, parts' output sizes, input size, each sequence's (slot, rows))
    "decode_mixed_r8_r16_and_base": ([8, 16, 16], [72], 40, [(0, 1), (BASE, 1), (2, 1), (1, 1)]),
    "prefill_wider_than_a_block": ([16, 8], [33], 96, [(1, 19), (BASE, 5), (0, 3), (1, 2)]),
    "fused_qkv_parts_odd_sizes": ([8, 16], [48, 24, 24], 56, [(0, 7), (1, 1), (BASE, 2)]),
    "some_slots_absent": ([16, 8, 16, 8], [130], 64, [(3, 4), (BASE, 3), (1, 18), (3, 1)]),
}


@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_matches_the_torch_path_and_each_rows_delta(case, dtype, device):
    ranks, parts, input_size, sequences = CASES[case]
    slots, lengths = [s for s, _ in sequences], [n for _, n in sequences]
    starts, row_slots = sequence_slots(slots, lengths)
    mapping = LoraMapping.of(slots, starts, torch.device(device), len(ranks))
    assert mapping.slots, "a case with adapters"
    a, b, scalings = stacked(ranks, 16, parts, input_size, seed=len(case))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(len(row_slots), input_size, generator=gen)
    base = torch.randn(len(row_slots), sum(parts), generator=gen)
    x, base, a, b, scalings = (t.to(device, dtype) for t in (x, base, a, b, scalings))
    # from the operands as rounded to dtype: what is left is the paths' own rounding
    expected = per_row(x.cpu(), base.cpu(), a.cpu(), b.cpu(), scalings.cpu(), row_slots)
    layout = (mapping.gather, mapping.valid, mapping.rows, mapping.width, mapping.subset)

    out = triton_lora.add_lora(x, base.clone(), a, b, scalings, *layout)
    reference = lora.add_lora(x, base.clone(), a, b, scalings, *layout)

    assert out.dtype == dtype and out.shape == base.shape
    torch.testing.assert_close(out, reference, **TOLERANCE[dtype])
    torch.testing.assert_close(out.double(), expected.to(device), **TOLERANCE[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(reference.double(), expected.to(device), **TOLERANCE[dtype])
    base_rows = [row for row, slot in enumerate(row_slots) if slot == BASE]
    assert torch.equal(out[base_rows], base[base_rows]), "base-model rows are left as they were"


def test_out_is_changed_in_place_even_when_not_contiguous(device):
    starts, row_slots = sequence_slots([0, BASE, 1], [3, 2, 2])
    mapping = LoraMapping.of([0, BASE, 1], starts, torch.device(device), 2)
    a, b, scalings = (t.to(device) for t in stacked([8, 16], 16, [24], 32, seed=3))
    x = torch.randn(len(row_slots), 32, device=device)
    wide = torch.randn(len(row_slots), 48, device=device)
    out = wide[:, :24]  # every other block of 24 columns: rows not contiguous
    expected = per_row(x.cpu(), out.cpu(), a.cpu(), b.cpu(), scalings.cpu(), row_slots)
    layout = (mapping.gather, mapping.valid, mapping.rows, mapping.width, mapping.subset)
    untouched = wide[:, 24:].clone()
    returned = triton_lora.add_lora(x, out, a, b, scalings, *layout)
    assert returned is out
    torch.testing.assert_close(out.double(), expected.to(device), **TOLERANCE[torch.float32])
    assert torch.equal(wide[:, 24:], untouched)


def test_the_layout_is_read_again_for_each_step(device):
    """The kernels keep the last step's group layout: a new step's mapping is worked out anew."""
    a, b, scalings = (t.to(device) for t in stacked([8, 16], 16, [20], 24, seed=5))
    for slots in ([0, 1, 0], [1, BASE, 1], [0, 0, 1]):
        lengths = [2, 5, 1]
        starts, row_slots = sequence_slots(slots, lengths)
        mapping = LoraMapping.of(slots, starts, torch.device(device), 2)
        x = torch.randn(len(row_slots), 24, device=device)
        base = torch.randn(len(row_slots), 20, device=device)
        expected = per_row(x.cpu(), base.cpu(), a.cpu(), b.cpu(), scalings.cpu(), row_slots)
        layout = (mapping.gather, mapping.valid, mapping.rows, mapping.width, mapping.subset)
        out = triton_lora.add_lora(x, base, a, b, scalings, *layout)
        torch.testing.assert_close(out.double(), expected.to(device), **TOLERANCE[torch.float32])


@pytest.fixture
def fresh_choice(monkeypatch):
    monkeypatch.delenv(ops.SETTING, raising=False)
    ops.reset()
    yield
    ops.reset()


@pytest.mark.usefixtures("fresh_choice")
def test_the_engine_picks_the_triton_kernels_on_cuda(monkeypatch, device):
    assert ops.kernels_for(torch.zeros(1)).add_lora is lora.add_lora
    monkeypatch.setenv(ops.SETTING, "triton")
    ops.reset()
    assert ops.kernels_for(torch.zeros(1, device=device)).add_lora is triton_lora.add_lora


@pytest.mark.usefixtures("fresh_choice")
def test_engine_on_the_triton_kernels_matches_transformers_with_peft(
    make_checkpoint, tmp_path_factory: pytest.TempPathFactory, monkeypatch, device
):
    """Two adapters (ranks 8 and 16) and the base model in the same steps, prefill and decode,
    every op on Triton (in the interpreter without a GPU: so tiny cut to one layer)."""
    tiny_llama = make_checkpoint("llama", num_hidden_layers=1)
    adapters = {
        "r8": make_adapter(tiny_llama, tmp_path_factory.mktemp("r8"), 8, 16, ATTENTION + MLP),
        "r16": make_adapter(
            tiny_llama, tmp_path_factory.mktemp("r16"), 16, 64, ["q_proj", "v_proj", *MLP], seed=1
        ),
    }
    monkeypatch.setenv(ops.SETTING, "triton")
    ops.reset()
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    llm = LLM(tiny_llama, device=device, dtype="float32", lora_modules=modules, num_kv_blocks=32)
    prompts = [[11, 502, 73, 9, 1200, 64, 31], [5, 17, 401, 96, 23], [7, 300, 41]]
    names = ["r8", None, "r16"]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, lora_name=names)
    expected = [
        peft_greedy(tiny_llama, None if name is None else adapters[name], prompt, 3)
        for name, prompt in zip(names, prompts, strict=True)
    ]
    assert [o.token_ids for o in outputs] == expected
    base = [peft_greedy(tiny_llama, None, prompt, 3) for prompt in prompts]
    assert expected[0] != base[0] and expected[2] != base[2], "adapters that change nothing"
    assert ops.kernels_for(torch.zeros(1, device=device)).add_lora is triton_lora.add_lora

"""Which kernels the engine runs (`PAGEDBATCH_KERNELS`), and the engine end to end on the Triton
kernels: the same greedy tokens as on the torch ones."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.kernels import ops, triton_attention, triton_norm


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    """Each test chooses under its own setting, and leaves no choice behind."""
    monkeypatch.delenv(ops.SETTING, raising=False)
    ops.reset()
    yield
    ops.reset()


def use(monkeypatch, setting: str) -> None:
    monkeypatch.setenv(ops.SETTING, setting)
    ops.reset()


def test_auto_runs_triton_on_cuda_and_torch_elsewhere(device):
    assert ops.kernels_for(torch.zeros(1)) is ops.TORCH
    if device == "cuda":
        cuda_kernels = ops.kernels_for(torch.zeros(1, device="cuda"))
        assert cuda_kernels.paged_attention is triton_attention.paged_attention


def test_triton_everywhere_on_request(monkeypatch, device):
    use(monkeypatch, "triton")
    chosen = ops.kernels_for(torch.zeros(1, device=device))
    assert chosen.paged_attention is triton_attention.paged_attention
    assert chosen.fused_add_rms_norm is triton_norm.fused_add_rms_norm


def test_the_choice_is_kept_until_reset(monkeypatch, device):
    x = torch.zeros(1, device=device)
    use(monkeypatch, "torch")
    assert ops.kernels_for(x) is ops.TORCH
    monkeypatch.setenv(ops.SETTING, "triton")
    assert ops.kernels_for(x) is ops.TORCH
    ops.reset()
    assert ops.kernels_for(x).rms_norm is triton_norm.rms_norm


def test_an_unknown_setting_is_refused(monkeypatch):
    use(monkeypatch, "cuda")
    with pytest.raises(ValueError, match="PAGEDBATCH_KERNELS must be one of auto, torch, triton"):
        ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter is for machines without a GPU"
)
def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    use(monkeypatch, "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.kernels_for(torch.zeros(1))


def test_the_package_imports_and_runs_without_triton():
    """The engine's kernels import no Triton until a call needs it, and without Triton installed
    the torch path runs and the Triton one fails with a clear message."""
    script = """
import sys
sys.modules["triton"] = None  # as if not installed: importing it raises ImportError
import torch
import pagedbatch.engine.worker.models.llama  # the engine's model, which calls the ops
from pagedbatch.kernels import ops
out = ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
assert out.shape == (2, 4)
ops.reset()
import os
os.environ["PAGEDBATCH_KERNELS"] = "triton"
os.environ["TRITON_INTERPRET"] = "1"
try:
    ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
except RuntimeError as e:
    print(e)
"""
    env = {k: v for k, v in os.environ.items() if k != ops.SETTING}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    assert "the Triton kernels need the triton package" in result.stdout


@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        # The experts' kernel too; in the interpreter 40 s, so on a GPU only (its tests beside
        # the torch one run everywhere: test_triton_moe.py).
        pytest.param(
            "mixtral",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="slow in the interpreter"
            ),
        ),
    ],
)
def test_engine_generates_the_torch_path_tokens(make_checkpoint, arch, monkeypatch, device):
    """Prompts that cross block boundaries, prefilled in chunks beside decodes, on a tiny pool."""
    prompts = [[11, 502, 73, 9, 1200, 64, 31, 880, 7, 45, 600, 21, 3000], [5, 17, 401, 96, 23]]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def generate(setting: str) -> list[list[int]]:
        use(monkeypatch, setting)
        llm = LLM(
            make_checkpoint(arch),
            device=device,
            dtype="float32",
            block_size=4,
            num_kv_blocks=12,
            max_num_batched_tokens=8,
        )
        return [output.token_ids for output in llm.generate(prompts, greedy)]

    expected = generate("torch")
    assert generate("triton") == expected
    assert ops.kernels_for(torch.zeros(1, device=device)).paged_attention is (
        triton_attention.paged_attention
    )

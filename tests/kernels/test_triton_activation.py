"""The Triton SiLU-and-mul kernel against the torch one (the reference).

Without a GPU the kernel runs in Triton's interpreter, on CPU tensors; on a GPU machine the same
tests run the compiled kernel on CUDA tensors."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package")
if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
    raise RuntimeError("without a GPU, tests/conftest.py must set TRITON_INTERPRET=1")

from pagedbatch.kernels import activation, triton_activation  # noqa: E402

# exp differs by an ulp or so between libraries. The interpreter rounds float32 to bfloat16 by
# truncation where GPUs (and torch) round to nearest: a bfloat16 ulp at each rounding.
TOLERANCE = {
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-6, atol=1e-5),
}


@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("d", [64, 1500], ids=["one_tile", "tiles_and_a_tail"])
def test_matches_the_torch_kernel(d, dtype):
    x = torch.randn(5, 2, 2 * d, generator=torch.Generator().manual_seed(0)).to(dtype).to(DEVICE)
    before = x.clone()
    out = triton_activation.silu_and_mul(x)
    assert out.shape == (5, 2, d) and out.dtype == dtype
    torch.testing.assert_close(out, activation.silu_and_mul(x), **TOLERANCE[dtype])
    assert torch.equal(x, before), "the input is left as it was"

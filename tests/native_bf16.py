"""Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): `dtype bfloat16` on the
CPU is refused at start where it does not, so the tests that run a model in it skip there."""

from __future__ import annotations

import pytest

from pagedbatch.engine.worker.model_runner import native_bfloat16

needs_native_bf16 = pytest.mark.skipif(
    not native_bfloat16(),
    reason="this CPU has no native bfloat16 (avx512_bf16 or amx_bf16): refused",
)

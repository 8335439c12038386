"""What the kernel test modules need, said once: the Triton modules (`test_triton_*.py`) and the
C kernels' two paths.

Each Triton kernel is tested against its torch counterpart (the reference). On a GPU machine the
tests run the compiled kernels on CUDA tensors; without a GPU the same tests run the kernels in
Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 for that, before
any kernel is defined). Without the triton package a Triton module is reported skipped, before
it is imported: its imports of the Triton kernels would fail. The torch reference tests beside
them run in every case.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch

from pagedbatch.kernels import native

TRITON_MODULES = "test_triton_*.py"


class TritonModule(pytest.Module):
    """A Triton test module: skipped without triton; an error on CPU without the interpreter."""

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package")
        if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
            raise RuntimeError("without a GPU, tests/conftest.py must set TRITON_INTERPRET=1")
        return super().collect()


def pytest_pycollect_makemodule(
    module_path: Path, parent: pytest.Collector
) -> pytest.Module | None:
    if module_path.match(TRITON_MODULES):
        return TritonModule.from_parent(parent, path=module_path)
    return None


@pytest.fixture(scope="session")
def device() -> str:
    """Where the Triton kernels' tensors live: CUDA on a GPU machine, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["c_kernel", "torch"])
def native_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Runs a test twice: through the C kernels where they apply (float32 on the CPU), and with
    them turned off, through torch alone. Modules whose every test should, say
    `pytestmark = pytest.mark.usefixtures("native_path")`."""
    native.library.cache_clear()
    if request.param == "torch":
        monkeypatch.setenv(native.SETTING, "0")
    elif shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the C kernels")
    else:
        assert native.library() is not None, "the C kernels did not build; see the warning"
    yield request.param
    native.library.cache_clear()

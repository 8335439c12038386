"""Which activations a few-row product takes by default where quant_matmul.c streams a format
both ways (`quant_linear.activations_for`'s `auto`): int16 where it is clearly the faster on this
CPU, float32 elsewhere, whose products are exact.

Neither wins everywhere. int16 quantizes x per block of 32 and multiplies integers: on an AVX2
core (Zen 3) it runs in 0.67-0.8 of the float path's time. Where the AVX-512 units are full width
(Zen 5) the float path is as fast or faster: one thread, one row of a 1024 x 1024 weight in
cache, 0.95-1.15 of int16's time by format; a SmolLM2 decode step's fused layers, one request,
3.4 ms against 3.8. So the two kernels are timed on each format, once per build of the C kernels
(a build is per CPU's flags, compiler and source), and the answer is kept in a file beside the
library: every process on the machine then takes the same, where a choice made afresh in each
could flip between runs on a loaded machine and change greedy outputs' last bits.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from pagedbatch.kernels.quant_blocks import Format

logger = logging.getLogger(__name__)

# int16 where it took at most this share of float32's time.
INT16_SHARE = 0.9
# The weight each format is timed on: a layer's size, in a core's L2, where the arithmetic (not
# memory) tells the kernels apart.
ROWS, COLS = 1024, 1024
ROUNDS = 9


def chosen(lib: ctypes.CDLL) -> dict[Format, str]:
    """int16 or float32 for each format both kernels of `lib` stream: the saved answer, else
    measured now (some milliseconds) and saved."""
    return _chosen(lib, saved_path(lib))


def saved_path(lib: ctypes.CDLL) -> Path:
    """Where the answer for `lib` is kept: beside the library, which is built per CPU."""
    return Path(lib._name).with_suffix(".activations.json")


@functools.cache
def _chosen(lib: ctypes.CDLL, path: Path) -> dict[Format, str]:
    formats = [
        fmt
        for fmt in Format
        if lib.quant_int16_streamed(fmt.ggml_type) and lib.quant_float_streamed(fmt.ggml_type)
    ]
    try:
        saved = json.loads(path.read_text())
        answer = {fmt: saved[fmt.name] for fmt in formats}
        if set(answer.values()) <= {"int16", "float32"}:
            return answer
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none saved, or not a whole answer: measured anew
    answer = {fmt: faster(*_seconds(lib, fmt)) for fmt in formats}
    _save(path, {fmt.name: value for fmt, value in answer.items()})
    logger.info("few-row activations measured on this CPU: %s", answer)
    return answer


def faster(float_seconds: float, int16_seconds: float) -> str:
    """The activations to take, given each kernel's time."""
    return "int16" if int16_seconds <= INT16_SHARE * float_seconds else "float32"


def _seconds(lib: ctypes.CDLL, fmt: Format) -> tuple[float, float]:
    """One row's product by the float32 and the int16 kernel, each its best of `ROUNDS` taken in
    turn (a burst of load on the machine then costs both alike), on one thread."""
    blocks = torch.zeros(ROWS, fmt.row_bytes(COLS), dtype=torch.uint8)  # no subnormal products
    x, out = torch.ones(COLS), torch.empty(ROWS)
    kernels = (lib.quant_matmul_float, lib.quant_matmul_int16)
    best = [float("inf")] * len(kernels)
    for _ in range(ROUNDS):
        for i, kernel in enumerate(kernels):
            start = time.perf_counter()
            status = kernel(
                fmt.ggml_type, blocks.data_ptr(), ROWS, COLS, x.data_ptr(), 1, 1, out.data_ptr()
            )
            best[i] = min(best[i], time.perf_counter() - start)
            if status != 0:
                raise RuntimeError(f"the few-row kernels refused {fmt.name} ({status})")
    return best[0], best[1]


def _save(path: Path, answer: dict[str, str]) -> None:
    """Written beside the target and renamed, as the library is; left unsaved where it cannot be
    (the next process measures again)."""
    try:
        fd, staging = tempfile.mkstemp(prefix=".activations-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(answer, f)
        os.replace(staging, path)
    except OSError as e:
        logger.warning("could not keep the few-row activations measured here in %s: %s", path, e)

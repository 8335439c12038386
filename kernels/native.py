"""The CPU kernels written in C (`cpu_attention.c`, `cpu_rotary.c`, `quant_matmul.c`,
`decode_layer.c`, `greedy_screen.c`), compiled on first use with the machine's C compiler and
loaded with ctypes.

They are plain C with OpenMP, not a torch extension: compiling one takes about a second, where a
file including torch's headers takes a minute. The library is built for this CPU
(`-march=native`) into `$XDG_CACHE_HOME/pagedbatch/kernels/`, keyed by the source, the compiler and
the CPU's flags, so later processes load it at once. It links the OpenMP runtime that torch has
already loaded (same soname), so the two share one thread pool.

Where there is no compiler, or the build fails, `library()` returns None after one warning and the
callers keep to their torch paths. `PAGEDBATCH_NATIVE_KERNELS=0` turns the C kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SETTING = "PAGEDBATCH_NATIVE_KERNELS"
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_attention.c", "cpu_rotary.c", "quant_matmul.c", "decode_layer.c", "greedy_screen.c"
    )
)  # fmt: skip
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
# -std=c11 alone would turn off fused multiply-adds (ISO C's default contraction rule).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_i64, _i32, _f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_float
_ptr = ctypes.c_void_p
# Argument types of each exported function, in order.
SIGNATURES: dict[str, list[type]] = {
    "paged_decode_attention_kv": [
        _ptr, _ptr, _ptr,  # query, key cache, value cache
        _ptr, _ptr, _i32,  # key scales, value scales (a quantized cache's), format
        _i64,  # elements a scale covers (a quantized cache's)
        _ptr, _i64,  # block tables, their width
        _ptr, _ptr, _ptr, _ptr, _i64,  # token rows, table rows, first keys, seq lens, how many
        _i64, _i64, _i64, _i64,  # heads, KV heads, head dim, block size
        _f32, _i32, _ptr,  # scale, threads, out
    ],
    "rotary_embedding": [
        _ptr, _i64,  # positions, how many
        _ptr, _i64, _i64,  # query, its token stride, its heads
        _ptr, _i64, _i64,  # key, its token stride, its heads
        _i64, _ptr, _i64, _i32,  # head dim, cos/sin table, its rows, threads
        _ptr, _ptr,  # query out, key out
    ],
    **dict.fromkeys(("quant_matmul_float", "quant_matmul_int8", "quant_matmul_int16"), [
        _i32, _ptr, _i64, _i64,  # ggml type, blocks, rows, cols
        _ptr, _i64, _i32, _ptr,  # x, its rows, threads, out
    ]),
    "quant_dequantize": [
        _i32, _ptr, _i64, _i64,  # ggml type, blocks, rows, cols
        _i32, _ptr,  # threads, out
    ],
    "quant_decode_layer": [
        _ptr, _ptr,  # the layer's struct, the step's (decode_layer.py)
        _ptr, _ptr, _i32, _ptr,  # x, residual, whether there is one, out
    ],
    "quant_kernel_isa": [],
    "quant_float_streamed": [_i32],  # ggml type
    "quant_int16_streamed": [_i32],  # ggml type
    "screen_candidates": [
        _ptr, _i64, _i64, _ptr, _ptr,  # approximate logits, rows, width, margins, norms
        _ptr, _i64, _i64,  # floors, the slice's first id, room for candidates
        _ptr, _ptr, _ptr, _i32,  # candidates' rows, ids, upper bounds; threads
    ],
}  # fmt: skip


def enabled() -> bool:
    return os.environ.get(SETTING, "1").strip() not in {"0", "false", "no", "off"}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first call; None where they cannot be (logged once)."""
    return load(SOURCES, "cpu_kernels", SIGNATURES, "the C kernels", "using the torch paths")


def load(
    sources: tuple[Path, ...],
    stem: str,
    signatures: dict[str, list[type]],
    what: str,
    instead: str,
) -> ctypes.CDLL | None:
    """`sources` built into a library (`_build`) and loaded, each of `signatures`' functions
    typed (returning an int); None where the C kernels are off or cannot be built, with a
    warning naming `what` and what runs `instead`."""
    if not enabled():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found for %s: %s", what, instead)
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler, sources, stem)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("could not build %s (%s): %s", what, detail, instead)
        return None
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int
    return lib


def _build(compiler: str, sources: tuple[Path, ...] = SOURCES, stem: str = "cpu_kernels") -> Path:
    """`sources` compiled into one library in the cache (built once per source, compiler and
    CPU), named `stem`-digest.so: its path."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    digest = hashlib.sha256()
    flags = " ".join(sorted(cpu_flags())) or platform.processor()
    for part in (version, " ".join(FLAGS), platform.machine(), flags):
        digest.update(part.encode())
    for source in (*sources, *headers(sources)):
        digest.update(source.read_bytes())
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    target = Path(base) / "pagedbatch" / "kernels" / f"{stem}-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: the temporary directory serves
        target = Path(tempfile.gettempdir()) / "pagedbatch" / "kernels" / target.name
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed: a racing process loads a whole file or builds its own.
    fd, staging = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, *map(str, sources), "-o", staging, "-lm"],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(staging, target)
    finally:
        Path(staging).unlink(missing_ok=True)
    logger.info("built the C kernels into %s", target)
    return target


def headers(sources: tuple[Path, ...]) -> tuple[Path, ...]:
    """The headers `sources` include by a quoted name (`#include "quant_formats.h"`), beside
    them, each once in the order first met: part of what a build digest hashes, so that an edited
    header rebuilds every library that includes it. Headers including others are followed."""
    found: dict[Path, None] = {}
    pending = list(sources)
    while pending:
        source = pending.pop(0)
        for name in _QUOTED_INCLUDE.findall(source.read_text()):
            header = source.with_name(name)
            if header not in found:
                found[header] = None
                pending.append(header)
    return tuple(found)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (`avx2`, `amx_bf16`, ...), which
    `-march=native` compiles for; empty where /proc/cpuinfo does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()

"""The quantized KV cache (kv_quant: int8 or float8 e4m3 rows, a float32 scale per group of 32
elements of a slot's KV head): the rows it stores, and attention over it through the C kernel (as
built here, and for AVX2 and a portable x86-64), torch and Gemma 2's soft-capped path, against
float64 references.

Two checks per attention case: against the float64 attention of the dequantized cache (the
kernel's own arithmetic: float32 rounding only), and against that of the original values, within
the bound the format's rounding allows (see `quantization_bound`)."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_attention import SCENARIOS, Batch, make_batch, reference_attention

from pagedbatch.engine.worker.models.softcap_attention import softcapped_paged_attention
from pagedbatch.kernels import kv_quant, native
from pagedbatch.kernels.attention import paged_attention, prepare_attention, reshape_and_cache
from pagedbatch.kernels.kv_quant import QuantizedCache

FORMATS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# The models' head sizes (tiny 16 and 32, SmolLM2 64, Phi-3 96, Llama and Qwen 128, Gemma 3 256)
# and 40, a multiple of neither vector width of the C kernel's AVX-512 build.
HEAD_DIMS = [16, 32, 40, 64, 96, 128, 256]
HEADS = {"mha": (4, 4), "gqa3": (6, 2)}


def quantize_batch(batch: Batch, dtype: torch.dtype) -> tuple[QuantizedCache, QuantizedCache]:
    """The batch's caches quantized; slots never written (NaN in make_batch's caches) get NaN
    scales, so that a kernel reading one shows it. The batch's own caches become the dequantized
    values (NaN where unwritten): the reference the kernels' arithmetic is held to."""
    caches = []
    for name in ("key_cache", "value_cache"):
        values = getattr(batch, name)
        unwritten = values.isnan().any(dim=-1)
        data, scales = kv_quant.quantize(torch.nan_to_num(values), dtype)
        scales[unwritten] = float("nan")
        caches.append(QuantizedCache(data, scales))
        setattr(batch, name, kv_quant.dequantize(data, scales, torch.float32))
    return caches[0], caches[1]


def element_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The most an element of rows x `[..., head_dim]` may move when stored in `dtype`: half a
    step of its group's scale for int8; for e4m3, 2^-4 of its magnitude (3 mantissa bits), or
    2^-10 of the scale below e4m3's normal range. A float32 rounding's worth on top."""
    group = kv_quant.group_size(x.shape[-1])
    amax = x.unflatten(-1, (-1, group)).abs().amax(dim=-1).repeat_interleave(group, dim=-1)
    scales = amax / kv_quant.LARGEST[dtype]
    if dtype == torch.int8:
        bound = (scales / 2).expand_as(x)
    else:
        bound = torch.maximum(x.abs() * 2**-4, scales * 2**-10)
    return bound + x.abs() * 2**-22


def quantization_bound(batch: Batch, original: Batch, dtype: torch.dtype, scale: float):
    """Per (token, head), the most the attention output may move when K and V are stored in
    `dtype`: a score moves by at most eps = scale * sum_d |q_d| * (K's element bound), so each
    softmax weight by a factor within e^(+-2 eps) and the weights by at most e^(2 eps) - 1 in
    total, times the largest |value|; plus V's own element bound."""
    num_heads = batch.query.shape[1]
    group = num_heads // batch.key_cache.shape[2]
    bound = torch.empty(batch.query.shape[:2], dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        slots = _slots(batch, i, seq_len)
        k = original.key_cache.flatten(0, 1)[slots].double()
        v = original.value_cache.flatten(0, 1)[slots].double()
        k_err = element_bound(k, dtype).repeat_interleave(group, dim=1)  # [keys, heads, dim]
        v_err = element_bound(v, dtype).amax(dim=(0, 2)).repeat_interleave(group)  # [heads]
        v_max = v.abs().amax(dim=(0, 2)).repeat_interleave(group)
        q = batch.query[start:end].double().abs()
        eps = scale * torch.einsum("qhd,khd->qhk", q, k_err).amax(dim=-1)  # [queries, heads]
        bound[start:end] = torch.expm1(2 * eps) * v_max + v_err
    return bound


def _slots(batch: Batch, seq: int, seq_len: int) -> torch.Tensor:
    blocks = batch.blocks[seq]
    size = batch.block_size
    return torch.tensor([blocks[p // size] * size + p % size for p in range(seq_len)])


def attend(batch: Batch, caches: tuple[QuantizedCache, QuantizedCache], scale, window):
    meta = prepare_attention(
        batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.block_size
    )
    return paged_attention(batch.query, *caches, meta, scale, window)


def check(seqs, heads, fmt, window=None, head_dim=32, block_size=16, dtype=torch.float32):
    original = make_batch(seqs, *heads, dtype=dtype, head_dim=head_dim, block_size=block_size)
    batch = make_batch(seqs, *heads, dtype=dtype, head_dim=head_dim, block_size=block_size)
    caches = quantize_batch(batch, FORMATS[fmt])
    scale = head_dim**-0.5
    out = attend(batch, caches, scale, window).double()
    # The kernels' arithmetic on the stored values: float32 (or the query's dtype) rounding.
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out, reference_attention(batch, scale, window), atol=tolerance,
                               rtol=0)  # fmt: skip
    # Against the unquantized values: within what the format's rounding allows.
    error = (out - reference_attention(original, scale, window)).abs().amax(dim=-1)
    bound = quantization_bound(batch, original, FORMATS[fmt], scale) + tolerance
    assert (error <= bound).all(), f"error {error.max():.3g} past its bound {bound.min():.3g}"


@pytest.mark.usefixtures("native_path")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_attention_over_a_quantized_cache(scenario, heads, window, fmt):
    check(SCENARIOS[scenario], heads, fmt, window)


@pytest.mark.usefixtures("native_path")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_head_size_the_models_use(head_dim, fmt):
    check(SCENARIOS["mixed"], HEADS["gqa3"], fmt, head_dim=head_dim)


@pytest.mark.usefixtures("native_path")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_block_tails_of_any_block_size(block_size, fmt):
    # Contexts ending mid-block and decode chunks of fewer slots than a vector.
    seqs = [(1, 1), (block_size + 3, 1), (3 * block_size - 1, 1), (2 * block_size + 6, 5)]
    check(seqs, HEADS["gqa3"], fmt, window=None, block_size=block_size)


@pytest.mark.parametrize("fmt", FORMATS)
def test_half_precision_queries_read_it_too(fmt):
    check(SCENARIOS["mixed"], HEADS["gqa3"], fmt, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("head_dim", "group"), [(64, 32), (96, 32), (128, 32), (256, 32), (16, 16), (40, 8)]
)
def test_a_scale_covers_32_elements_or_the_most_that_divide_the_head(head_dim, group):
    assert kv_quant.group_size(head_dim) == group
    assert kv_quant.scales_per_row(head_dim) == head_dim // group
    # a byte an element and 4 bytes a scale; float32 and bfloat16 rows have no scales
    assert kv_quant.bytes_per_row(torch.int8, head_dim) == head_dim + 4 * (head_dim // group)
    assert kv_quant.bytes_per_row(torch.bfloat16, head_dim) == 2 * head_dim


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_group_stores_its_extreme_exactly_and_the_rest_within_the_bound(fmt):
    dtype = FORMATS[fmt]
    rows = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(1)) * 5
    rows[0, 0] = 0.0  # an all-zero row: scale 1, zeros
    rows[1, 0, 32:] = 0.0  # an all-zero group beside one that is not
    data, scales = kv_quant.quantize(rows, dtype)
    assert data.dtype == dtype and scales.shape == (50, 3, 2)
    assert (scales[0, 0] == 1).all() and scales[1, 0, 1] == 1
    extremes = data.float().unflatten(-1, (2, 32)).abs().amax(dim=-1)
    assert (extremes[2:] == kv_quant.LARGEST[dtype]).all()
    restored = kv_quant.dequantize(data, scales, torch.float32)
    assert ((restored - rows).abs() <= element_bound(rows, dtype)).all()
    assert (restored[0, 0] == 0).all() and (restored[1, 0, 32:] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_large_element_coarsens_only_its_own_group(fmt):
    # A key's outlier channel (Gemma 3's are 20-60x the others): the other group keeps the
    # steps of its own extreme.
    dtype = FORMATS[fmt]
    row = torch.randn(64, generator=torch.Generator().manual_seed(3))
    row[5] = 200.0
    restored = kv_quant.dequantize(*kv_quant.quantize(row, dtype), torch.float32)
    other = row[32:]
    step = other.abs().max() / kv_quant.LARGEST[dtype]
    assert ((restored[32:] - other).abs() <= torch.maximum(other.abs() * 2**-4, step / 2)).all()
    assert (restored[:32] - row[:32]).abs().max() > step  # the outlier's group: coarser


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_write_quantizes_into_the_slots_the_mapping_names(fmt):
    dtype = FORMATS[fmt]
    cache_shape = (6, 4, 2, 32)
    k_cache = kv_quant.empty_cache(cache_shape, dtype, torch.device("cpu"))
    v_cache = kv_quant.empty_cache(cache_shape, dtype, torch.device("cpu"))
    for cache in (k_cache, v_cache):
        cache.data.view(torch.uint8).fill_(0x55)
        cache.scales.fill_(-1.0)
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(2, 5, 2, 32, generator=gen)
    slots = torch.tensor([3, 17, 0, 22, 9])
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    for cache, rows in ((k_cache, key), (v_cache, value)):
        stored = kv_quant.gather(cache, slots, torch.float32)
        assert ((stored - rows).abs() <= element_bound(rows, dtype)).all()
        others = torch.ones(24, dtype=torch.bool)
        others[slots] = False
        assert (cache.scales.view(24, 2, -1)[others] == -1).all()
        assert (cache.data.view(torch.uint8).view(24, 64)[others] == 0x55).all()


def fp8_bytes(head_dim: int = 256) -> torch.Tensor:
    """Every float8 e4m3 byte but the two NaNs (0x7f, 0xff), as one row of 256."""
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0
    return codes.to(torch.uint8)[:head_dim]


def one_key_batch(values: torch.Tensor, dtype: torch.dtype):
    """A one-token sequence whose single value row is `values` (stored bytes, scale 1): the
    attention output is that row widened to floats."""
    head_dim = values.numel()
    data = torch.zeros(2, 1, 1, head_dim, dtype=torch.uint8)
    data[1, 0, 0] = values
    scales = torch.ones(2, 1, 1, kv_quant.scales_per_row(head_dim))
    keys = QuantizedCache(data[0].view(dtype)[None], scales[0][None])
    vals = QuantizedCache(data[1].view(dtype)[None], scales[1][None])
    meta = prepare_attention(
        torch.tensor([0, 1]), torch.tensor([1]), torch.zeros(1, 1, dtype=torch.int32), 1
    )
    return torch.randn(1, 1, head_dim), keys, vals, meta


@pytest.mark.usefixtures("native_path")
def test_every_fp8_value_widens_exactly():
    values = fp8_bytes()
    query, keys, vals, meta = one_key_batch(values, torch.float8_e4m3fn)
    out = paged_attention(query, keys, vals, meta, 1.0)
    expected = values.view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(out[0, 0], expected, atol=0, rtol=0)


def test_gemma2s_softcapped_attention_reads_it(monkeypatch):
    for fmt, dtype in FORMATS.items():
        batch = make_batch(SCENARIOS["mixed"], 6, 2)
        caches = quantize_batch(batch, dtype)
        meta = prepare_attention(
            batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.block_size
        )
        args = (meta, 0.2, 5.0, 9)
        # The dequantized caches hold NaN where unwritten, as the quantized ones' scales do.
        out = softcapped_paged_attention(batch.query, *caches, *args)
        expected = softcapped_paged_attention(
            batch.query, batch.key_cache, batch.value_cache, *args
        )
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0, msg=fmt)


# -- the C kernel's other builds -----------------------------------------------------------------

X86_BUILDS = {"avx2": "-march=x86-64-v3", "portable": "-march=x86-64"}


@pytest.fixture(scope="module", params=X86_BUILDS)
def other_build(request, tmp_path_factory) -> ctypes.CDLL:
    """cpu_attention.c built for another x86-64 level than this CPU's (-march=native): AVX2's
    vectors of eight, or the baseline's SSE2. Each runs on any x86-64 CPU that has it."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.machine() not in {"x86_64", "AMD64"}:
        pytest.skip("needs a C compiler on x86-64")
    flag = X86_BUILDS[request.param]
    if request.param == "avx2" and "avx2" not in native.cpu_flags():
        pytest.skip("the CPU has no AVX2")
    source = Path(native.__file__).with_name("cpu_attention.c")
    target = tmp_path_factory.mktemp("builds") / f"attention-{request.param}.so"
    flags = [f for f in native.FLAGS if not f.startswith("-march")]
    subprocess.run([compiler, *flags, flag, str(source), "-o", str(target), "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    lib.paged_decode_attention_kv.argtypes = native.SIGNATURES["paged_decode_attention_kv"]
    lib.paged_decode_attention_kv.restype = ctypes.c_int
    return lib


def decode_with(lib: ctypes.CDLL, query, keys, values, meta, scale, fmt_code=None, group=None):
    from pagedbatch.kernels import attention

    rows = attention.decode_rows(meta, None)
    query = query.contiguous()  # kept: the kernel reads it through a pointer
    out = torch.zeros_like(query)
    code = attention.C_FORMATS[keys.dtype] if fmt_code is None else fmt_code
    group = kv_quant.group_size(query.shape[2]) if group is None else group
    scales = [c.scales.data_ptr() if isinstance(c, QuantizedCache) else 0 for c in (keys, values)]
    status = lib.paged_decode_attention_kv(
        query.data_ptr(), keys.data.data_ptr(), values.data.data_ptr(), *scales, code, group,
        rows.tables.data_ptr(), rows.tables.shape[1],
        rows.token_rows.data_ptr(), rows.table_rows.data_ptr(), rows.first_keys.data_ptr(),
        rows.seq_lens.data_ptr(), rows.token_rows.numel(),
        query.shape[1], keys.shape[2], query.shape[2], meta.block_size,
        scale, 1, out.data_ptr(),
    )  # fmt: skip
    return status, out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
def test_other_builds_match_the_reference(other_build, head_dim, fmt):
    batch = make_batch(SCENARIOS["decode_lengths_spread"], 6, 2, head_dim=head_dim)
    caches = quantize_batch(batch, FORMATS[fmt])
    meta = prepare_attention(
        batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.block_size
    )
    scale = head_dim**-0.5
    status, out = decode_with(other_build, batch.query, *caches, meta, scale)
    assert status == 0
    expected = reference_attention(batch, scale, None)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_other_builds_read_a_half_precision_cache(other_build, dtype):
    batch = make_batch(SCENARIOS["decode_lengths_spread"], 6, 2, head_dim=64)
    batch.key_cache, batch.value_cache = batch.key_cache.to(dtype), batch.value_cache.to(dtype)
    meta = prepare_attention(
        batch.query_start_loc, batch.seq_lens, batch.block_tables, batch.block_size
    )
    status, out = decode_with(other_build, batch.query, batch.key_cache, batch.value_cache, meta,
                              0.125)  # fmt: skip
    assert status == 0
    expected = reference_attention(batch, 0.125, None)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_other_builds_widen_every_fp8_value_exactly(other_build):
    values = fp8_bytes()
    query, keys, vals, meta = one_key_batch(values, torch.float8_e4m3fn)
    status, out = decode_with(other_build, query, keys, vals, meta, 1.0)
    assert status == 0
    expected = values.view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(out[0, 0], expected, atol=0, rtol=0)


def test_an_unknown_format_or_a_group_that_splits_the_head_is_refused(other_build):
    query, keys, vals, meta = one_key_batch(fp8_bytes(64), torch.float8_e4m3fn)
    for wrong in ({"fmt_code": 7}, {"group": 24}, {"group": 0}):
        status, out = decode_with(other_build, query, keys, vals, meta, 1.0, **wrong)
        assert status == -2 and (out == 0).all(), wrong

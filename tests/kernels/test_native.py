"""The C kernels' build: once per source, compiler and CPU, into the user's cache, and a warning
with the torch paths where it cannot be built."""

from __future__ import annotations

import logging
import shutil

import pytest

from pagedbatch.kernels import native

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


@pytest.fixture(autouse=True)
def fresh_library(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    native.library.cache_clear()
    yield
    native.library.cache_clear()


@needs_compiler
def test_built_once_into_the_cache_then_loaded(tmp_path):
    assert native.library() is not None
    (built,) = (tmp_path / "cache" / "pagedbatch" / "kernels").glob("cpu_kernels-*.so")
    first_build = built.stat().st_mtime_ns
    native.library.cache_clear()
    assert native.library() is not None
    assert built.stat().st_mtime_ns == first_build
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no staging file left


def test_a_failed_build_warns_and_leaves_the_torch_paths(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.library() is None
    assert "could not build the C kernels" in caplog.text
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_the_setting_turns_them_off(monkeypatch):
    monkeypatch.setenv(native.SETTING, "0")
    assert native.library() is None


def test_the_headers_a_source_includes_by_name_are_found_beside_it(tmp_path):
    (tmp_path / "inner.h").write_text("#define SEVEN 7\n")
    (tmp_path / "outer.h").write_text('#include "inner.h"\n#include <stdint.h>\n')
    source = tmp_path / "kernel.c"
    source.write_text('#include <math.h>\n#include "outer.h"\n  # include "inner.h"\n')
    assert native.headers((source,)) == (tmp_path / "outer.h", tmp_path / "inner.h")


def test_the_kernels_headers_ship_beside_them():
    """quant_matmul.c and quant_gemm.c share their formats' tables in one header."""
    assert {h.name for h in native.headers(native.SOURCES)} >= {"quant_formats.h"}


@needs_compiler
def test_an_edited_header_rebuilds_the_library(tmp_path):
    header = tmp_path / "answer.h"
    header.write_text("#define ANSWER 41\n")
    source = tmp_path / "answer.c"
    source.write_text('#include "answer.h"\nint answer(void) { return ANSWER; }\n')
    signatures: dict[str, list[type]] = {"answer": []}
    assert native.load((source,), "answer", signatures, "a test", "nothing").answer() == 41
    header.write_text("#define ANSWER 42\n")
    assert native.load((source,), "answer", signatures, "a test", "nothing").answer() == 42
    assert len(list((tmp_path / "cache").rglob("answer-*.so"))) == 2

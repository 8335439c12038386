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

"""Where derived files are kept: the user's cache, or the temporary directory where that cannot be
written."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from pagedbatch.user_cache import cache_dir, cache_entry


def test_an_entry_goes_under_the_users_cache_with_its_directory_made(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    entry = cache_entry("kernels", "lib.so")
    assert cache_dir("kernels") == tmp_path / "pagedbatch" / "kernels"
    assert entry == cache_dir("kernels") / "lib.so"
    assert entry.parent.is_dir() and not entry.exists()


def test_an_unwritable_cache_gives_the_temporary_directory_with_a_warning(
    tmp_path: Path, monkeypatch, caplog
):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_dir))
    with caplog.at_level(logging.WARNING, logger="pagedbatch.user_cache"):
        entry = cache_entry("kernels", "lib.so")
    assert entry == Path(tempfile.gettempdir()) / "pagedbatch" / "kernels" / "lib.so"
    assert entry.parent.is_dir()
    assert "cannot write to" in caplog.text

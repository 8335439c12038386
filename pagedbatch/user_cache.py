"""The user's cache: what pagedbatch derives once per machine and then reuses (a GGUF file's
metadata, the compiled C kernels; for the tests, the trained models and transformers' answers).

Kept in `$XDG_CACHE_HOME/pagedbatch/<kind>/` (`~/.cache` by default). Where that cannot be
written (a read-only home, say), the temporary directory's `pagedbatch/<kind>/` serves, with a
warning. Entries are keyed by what decides them and built beside their place, then renamed in,
by their owners; this module only says where they go.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir(kind: str) -> Path:
    """The user's cache directory for `kind`, made or not."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedbatch" / kind


def cache_entry(kind: str, name: str) -> Path:
    """Where entry `name` of `kind` is kept, its directory made: the user's cache, or where that
    cannot be written and does not hold the entry already, the temporary directory's."""
    entry = cache_dir(kind) / name
    if entry.exists():
        return entry
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fallback = Path(tempfile.gettempdir()) / "pagedbatch" / kind / name
        logger.warning("cannot write to %s (%s); keeping it in %s", entry.parent, e, fallback)
        fallback.parent.mkdir(parents=True, exist_ok=True)
        return fallback
    return entry

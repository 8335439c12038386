"""Ids and timestamps, as OpenAI's objects carry them."""

from __future__ import annotations

import secrets
import time


def new_id(prefix: str) -> str:
    """A unique id that sorts by creation time (microseconds, then random), so lists ordered by
    (created_at, id) keep creation order within a second."""
    return f"{prefix}{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


def now() -> int:
    """Unix seconds."""
    return int(time.time())

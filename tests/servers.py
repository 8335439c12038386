"""The live servers API tests talk to: what a started server offers a test.

A module of its own (not conftest.py) so test modules can import these names unambiguously.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from pagedbatch.service import Embedded
from pagedbatch.settings import Settings

API_KEYS = ["k1", "k2"]
STORAGES = ["embedded", "distributed"]
START_SECONDS = 30.0


@dataclass
class Storage:
    kind: str  # "embedded" or "distributed"
    settings: dict[str, Any]
    blob_keys: Callable[[], list[str]]  # every key in blob storage, to see what was left behind


@dataclass
class Server:
    url: str
    settings: Settings
    blob_keys: Callable[[], list[str]]

    def client(self, api_key: str = "unused", **options: Any) -> openai.OpenAI:
        # No retries: a test sees each response the server gave.
        options.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, **options)

    def http(self, api_key: str | None = None) -> httpx.Client:
        """A plain HTTP client, for what the SDK cannot send or hides."""
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@dataclass
class BatchServer(Server):
    embedded: Embedded

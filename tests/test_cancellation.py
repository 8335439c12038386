"""A cancelled task ends. Shutdowns cancel their loops (a shard's lease watcher, an engine host's
heartbeat) and then wait for them: a cancellation that is swallowed leaves that wait hanging for
ever. Two swallowers are kept out: Python 3.11's `asyncio.wait_for`, which returns its result
instead when the awaited completes as the cancellation arrives, and redis-py 8.1's asyncio
client, which loses a cancellation that lands during a command."""

from __future__ import annotations

import ast
import asyncio
import random
from pathlib import Path

import pytest
from harness import REDIS_URL
from redis.asyncio import Redis
from test_layout import FOLDERS, ROOT


def product_files() -> list[Path]:
    return sorted(path for folder in FOLDERS.values() for path in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", product_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_no_code_of_ours_awaits_with_asyncio_wait_for(path: Path):
    calls = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "wait_for"
        and isinstance(node.value, ast.Name)
        and node.value.id == "asyncio"
    ]
    assert not calls, f"asyncio.wait_for at lines {calls}: use `async with asyncio.timeout()`"


def test_a_task_cancelled_during_a_redis_command_ends():
    async def commands(redis: Redis) -> None:
        while True:
            await redis.set("pagedbatch-test-cancellation", "x", px=1000)

    async def main() -> None:
        redis = Redis.from_url(REDIS_URL)
        try:
            for _ in range(200):  # the cancellation lands at a different point of a command
                task = asyncio.create_task(commands(redis))
                await asyncio.sleep(random.uniform(0, 0.005))
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=2)
                assert done, "the cancellation was swallowed: the task runs on"
                assert task.cancelled()
        finally:
            await redis.aclose()

    asyncio.run(main())

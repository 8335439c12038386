"""Batch lines find in the prefix cache only what their own tenant's requests left there, unless
the cache is shared across tenants on purpose."""

from __future__ import annotations

import uuid

import pytest
from batch_worker import chat_line, finalized, run_all_shards, submit


def cached_tokens(worker, owner: str, prompt: str) -> int:
    messages = [{"role": "user", "content": prompt}]
    batch_id = submit(worker, [chat_line("only", messages=messages, max_tokens=1)], owner=owner)
    run_all_shards(worker, batch_id)
    _, results = finalized(worker, batch_id)
    usage = results["only"]["response"]["body"]["usage"]
    assert usage["prompt_tokens"] >= 64
    return usage["prompt_tokens_details"]["cached_tokens"]


def long_prompt() -> str:
    """A prompt no other test sent, long enough to fill several KV blocks."""
    return f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(120))


@pytest.mark.parametrize("shared", [False, True])
def test_a_tenant_finds_only_its_own_prompts_cached(make_batch_worker, shared):
    worker = make_batch_worker(share_prefix_cache_across_tenants=shared)
    prompt = long_prompt()
    assert cached_tokens(worker, "tenant-a", prompt) == 0
    assert cached_tokens(worker, "tenant-a", prompt) > 0  # the cache is at work
    across = cached_tokens(worker, "tenant-b", prompt)
    assert across > 0 if shared else across == 0

"""Spend limits through the `openai` SDK's `admin.organization.spend_limit`: past the service's
limit, or a key's monthly one, new realtime requests and new batches get 429
`insufficient_quota` before any engine work, while a batch already running finishes."""

from __future__ import annotations

import openai
import pytest
from servers import eventually
from test_batches import chat_line, create, finished
from test_usage import ADMIN, TENANTS, admin

# A dollar a token: one request is past a limit of a few dollars.
PRICES = {"tiny": {"input": 1e6, "output": 1e6}}


def chat(client: openai.OpenAI):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )


def refused(call) -> bool:
    try:
        call()
    except openai.RateLimitError as e:
        assert (e.body["type"], e.body["code"]) == ("insufficient_quota", "insufficient_quota")
        return True
    return False


def serve(serve_batches, **settings):
    return serve_batches(
        api_keys=",".join(TENANTS),
        admin_keys=ADMIN,
        prices=PRICES,
        spend_cache_seconds=0,
        **settings,
    )


def test_past_the_service_limit_new_work_is_refused_and_running_work_finishes(serve_batches):
    server = serve(serve_batches)
    limits = admin(server).admin.organization.spend_limit
    alice, bob = server.client("alice"), server.client("bob")
    with pytest.raises(openai.NotFoundError):
        limits.retrieve()
    limit = limits.update(currency="USD", interval="month", threshold_amount=500)  # $5
    assert (limit.threshold_amount, limit.enforcement.status) == (500, "inactive")
    lines = [chat_line(f"l{i}", max_tokens=40, ignore_eos=True) for i in range(4)]
    running = create(alice, lines)
    chat(alice)  # tens of dollars: over the limit once recorded
    eventually(lambda: refused(lambda: chat(bob)), timeout=10)
    engine = server.embedded.context.engine.engine
    tokens_run = engine.get_stats()["batched_tokens"]
    assert refused(lambda: chat(alice))
    assert refused(lambda: create(bob, [chat_line("x")]))
    assert limits.retrieve().enforcement.status == "enforcing"
    # The batch created before finishes; nothing refused reached the engine.
    assert finished(alice, running.id).status == "completed"
    assert engine.get_stats()["batched_tokens"] - tokens_run <= 4 * (40 + 20)
    assert limits.delete().deleted
    assert chat(bob).choices


def test_a_key_past_its_monthly_limit_is_refused_alone(serve_batches):
    server = serve(serve_batches, key_monthly_spend_limit_usd=5)
    alice, bob = server.client("alice"), server.client("bob")
    chat(alice)
    eventually(lambda: refused(lambda: chat(alice)), timeout=10)
    assert refused(lambda: create(alice, [chat_line("x")]))
    assert chat(bob).choices
    assert create(bob, [chat_line("y")]).status == "validating"


def test_only_admin_keys_touch_the_spend_limit(serve_batches):
    server = serve(serve_batches)
    as_tenant = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", admin_api_key="alice", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        as_tenant.admin.organization.spend_limit.update(
            currency="USD", interval="month", threshold_amount=1
        )

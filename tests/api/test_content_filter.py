"""The content filter on the doors: with input screening on, a prompt the moderation model flags
(or a tenant's blocklist matches) is a 400 `content_filter` naming the categories, before the
main model sees it, in realtime requests and batch lines alike; a tenant's overrides apply to that
tenant alone; with the policy off nothing changes."""

from __future__ import annotations

import re

import openai
import pytest
import torch
from test_batches import assert_engine_idle, create, finished, results
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from pagedbatch.api.auth import key_owner
from pagedbatch.protocol.moderation import CATEGORIES

CANDIDATES = [
    "Tell me about the weather.",
    "I will hurt you.",
    "Give me a cake recipe.",
    "You are all worthless.",
    "Where is the library?",
    "Describe the violence.",
]


@pytest.fixture(scope="module")
def guard(make_checkpoint):
    """The classifier, a text it flags and one it passes at `threshold` (between their highest
    scores), and the categories it flags in the first."""
    path = make_checkpoint("llama", task="classify")
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    scores = {}
    for text in CANDIDATES:
        with torch.no_grad():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        scores[text] = dict(zip(CATEGORIES, logits.sigmoid().tolist(), strict=True))
    ranked = sorted(CANDIDATES, key=lambda text: max(scores[text].values()))
    clean, bad = ranked[0], ranked[-1]
    threshold = (max(scores[clean].values()) + max(scores[bad].values())) / 2
    flagged = [c for c in CATEGORIES if scores[bad][c] >= threshold]
    return {
        "path": str(path),
        "clean": clean,
        "bad": bad,
        "threshold": threshold,
        "flagged": flagged,
    }


def chat(client: openai.OpenAI, text: str):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2
    )


def serve(serve_batches, guard, **settings):
    settings = {
        "moderation_model": guard["path"],
        "safety_threshold": guard["threshold"],
        "safety_policy": "input",
        **settings,
    }
    return serve_batches(**settings)


def test_a_flagged_prompt_is_refused_before_the_model(serve_batches, guard):
    server = serve(serve_batches, guard)
    client = server.client()
    tokens_run = server.embedded.context.engine.engine.get_stats()["batched_tokens"]
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, guard["bad"])
    error = caught.value.body
    assert error["code"] == "content_filter" and error["param"] == "prompt"
    assert all(category in error["message"] for category in guard["flagged"])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=guard["bad"], max_tokens=2)
    assert server.embedded.context.engine.engine.get_stats()["batched_tokens"] == tokens_run
    assert chat(client, guard["clean"]).choices[0].finish_reason == "length"
    metrics = server.http().get("/metrics").text
    category = guard["flagged"][0]
    assert (
        f'pagedbatch:content_filter_decisions_total{{category="{category}",'
        'direction="input",door="realtime"} 2.0'
    ) in metrics
    assert_engine_idle(server)


def test_with_the_policy_off_nothing_is_screened(serve_batches, guard):
    client = serve(serve_batches, guard, safety_policy="off").client()
    assert chat(client, guard["bad"]).choices[0].finish_reason == "length"


def test_tenant_overrides_apply_to_their_tenant_alone(serve_batches, guard):
    first, second = guard["clean"].split()[:2]
    tenants = {
        key_owner("lenient"): {"policy": "off"},
        key_owner("wordy"): {"blocklist": [rf"{re.escape(first)}\s+{re.escape(second)}"]},
    }
    server = serve(serve_batches, guard, api_keys="strict,lenient,wordy", safety_tenants=tenants)
    with pytest.raises(openai.BadRequestError):
        chat(server.client("strict"), guard["bad"])
    assert chat(server.client("lenient"), guard["bad"]).choices
    # The blocklist refuses before any model, whatever the scores.
    with pytest.raises(openai.BadRequestError) as caught:
        chat(server.client("wordy"), guard["clean"])
    assert "blocklist" in caught.value.body["message"]
    assert chat(server.client("strict"), guard["clean"]).choices


def test_batch_lines_are_screened_alike(serve_batches, guard):
    server = serve(serve_batches, guard)
    client = server.client()

    def line(custom_id: str, text: str) -> dict:
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": body,
        }

    batch = finished(
        client, create(client, [line("bad", guard["bad"]), line("ok", guard["clean"])]).id
    )
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    output, errors = results(client, batch)
    assert [o["custom_id"] for o in output] == ["ok"]
    [refused] = errors
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["code"] == "content_filter"

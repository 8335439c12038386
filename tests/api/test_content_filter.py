"""The content filter on the doors: with input screening on, a prompt the moderation model flags
(or a tenant's blocklist matches) is a 400 `content_filter` naming the categories, before the
main model sees it, in realtime requests and batch lines alike; a tenant's overrides apply to that
tenant alone; with the policy off nothing changes."""

from __future__ import annotations

import re

import openai
import pytest
from moderation_oracle import classifier_scores
from test_batches import assert_engine_idle, create, finished, results
from transformers import AutoTokenizer

from pagedbatch.api.auth import key_owner
from pagedbatch.moderation import CATEGORIES

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
    scores = dict(zip(CANDIDATES, classifier_scores(path, CANDIDATES), strict=True))
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
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=guard["bad"], max_output_tokens=16)
    assert server.embedded.context.engine.engine.get_stats()["batched_tokens"] == tokens_run
    assert chat(client, guard["clean"]).choices[0].finish_reason == "length"
    metrics = server.http().get("/metrics").text
    category = guard["flagged"][0]
    assert (
        f'pagedbatch:content_filter_decisions_total{{category="{category}",'
        'direction="input",door="realtime"} 3.0'
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


# Output screening. The guard's scores of what the tiny model writes are whatever they are, so
# the test reads them first (with the policy off) and sets one category's threshold between the
# scores of the output's first checked piece and of the whole output: the filter must then let
# the first piece out and stop the request before its end.

PROMPT = [(i * 131) % 3000 + 400 for i in range(12)]  # token ids: no template in the way
EVERY = 8  # tokens between checks
MAX_TOKENS = 6 * EVERY


def completion(client: openai.OpenAI, **options):
    return client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **options,
    )


def output_case(serve_batches, guard) -> tuple[dict, str, str]:
    """Settings under which the filter stops the output mid-way, the category it is stopped for,
    and the output unfiltered."""
    client = serve_batches(moderation_model=guard["path"]).client()
    text, pieces = "", []
    for chunk in completion(client, stream=True, logprobs=0):
        text += chunk.choices[0].text
        tokens = chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
        pieces.extend([text] * len(tokens))
    first = pieces[EVERY - 1]  # the text the first check reads
    asked = AutoTokenizer.from_pretrained(guard["path"]).decode(
        PROMPT
    )  # what input screening reads
    early, whole, prompt = (
        result.category_scores.model_dump(by_alias=True)
        for result in client.moderations.create(input=[first, text, asked]).results
    )
    # A category the output rises in, above where its first piece and the prompt stand.
    below = {c: max(early[c], prompt[c]) for c in CATEGORIES}
    category = max(CATEGORIES, key=lambda c: whole[c] - below[c])
    assert whole[category] - below[category] > 0.01, "no category rises along the output"
    threshold = (below[category] + whole[category]) / 2
    settings = {
        "moderation_model": guard["path"],
        "safety_policy": "output",
        "safety_category_thresholds": dict.fromkeys(CATEGORIES, 1.0) | {category: threshold},
        "safety_output_check_tokens": EVERY,
    }
    return settings, category, text


def test_flagged_output_stops_the_request(serve_batches, guard):
    settings, category, unfiltered = output_case(serve_batches, guard)
    server = serve_batches(**settings)
    client = server.client()
    threshold = settings["safety_category_thresholds"][category]

    def screened_clean(text: str) -> bool:
        """A beginning of the output, not all of it, below the threshold: what was screened."""
        if not (unfiltered.startswith(text) and text != unfiltered):
            return False
        if not text.strip():  # nothing to score (the endpoint refuses blank input): clean
            return True
        scores = client.moderations.create(input=text).results[0].category_scores
        return scores.model_dump(by_alias=True)[category] < threshold

    answer = completion(client).choices[0]
    assert answer.finish_reason == "content_filter"
    assert screened_clean(answer.text)
    # Streamed, the same. (Checks fall at the first output read at or past every 8 tokens, so
    # where the stream stops may differ from the whole answer's by a few tokens.)
    streamed, finish = "", None
    for chunk in completion(client, stream=True):
        streamed += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "content_filter" and screened_clean(streamed)
    assert_engine_idle(server)


def test_a_chat_reply_says_why_in_its_refusal(serve_batches, guard):
    # At threshold 0 every category flags whatever is written: the first check stops it.
    settings = {"moderation_model": guard["path"], "safety_policy": "output"}
    client = serve_batches(**settings, safety_threshold=0).client()
    messages = [{"role": "user", "content": "Write."}]
    options = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS}
    options["extra_body"] = {"ignore_eos": True}
    reply = client.chat.completions.create(**options).choices[0]
    assert reply.finish_reason == "content_filter" and not reply.message.content
    assert reply.message.refusal.startswith("The response was stopped by the content filter")
    assert all(category in reply.message.refusal for category in CATEGORIES)
    chunks = list(client.chat.completions.create(**options, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    last = chunks[-1].choices[0]
    assert last.finish_reason == "content_filter"
    assert last.delta.refusal == reply.message.refusal

    # A response is incomplete for the content filter, its message holding the refusal.
    asked = {"model": "tiny", "input": "Write.", "max_output_tokens": MAX_TOKENS}
    for response in (
        client.responses.create(**asked),
        list(client.responses.create(**asked, stream=True))[-1].response,
    ):
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "content_filter"
        (message,) = response.output
        assert [part.type for part in message.content] == ["output_text", "refusal"]
        assert message.content[1].refusal.startswith("The response was stopped by the content")


def test_a_batch_with_both_kinds_of_lines(serve_batches, guard):
    # Output is screened once, at a line's end; a prompt the blocklist refuses is an error line.
    settings, category, _ = output_case(serve_batches, guard)
    settings |= {"safety_policy": "both", "safety_blocklist": ["forbidden"]}
    client = serve_batches(**settings).client()
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    lines = [
        {"custom_id": "written", "method": "POST", "url": "/v1/completions", "body": body},
        {
            "custom_id": "asked",
            "method": "POST",
            "url": "/v1/completions",
            "body": {**body, "prompt": "Something forbidden"},
        },
    ]
    batch = finished(client, create(client, lines, endpoint="/v1/completions").id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    [output], [error] = results(client, batch)
    choice = output["response"]["body"]["choices"][0]
    assert (choice["finish_reason"], choice["text"]) == ("content_filter", "")
    assert error["custom_id"] == "asked" and error["response"]["status_code"] == 400
    assert "blocklist" in error["response"]["body"]["error"]["message"]

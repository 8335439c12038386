"""`/v1/moderations` through the `openai` SDK, on a classifier guard run by its own engine: the
scores are the classifier's, as transformers computes them; the threshold decides `flagged`;
bad input is a 400 that leaves the guard with no work."""

from __future__ import annotations

import openai
import pytest
from moderation_oracle import classifier_scores
from test_batches import create, finished, results

from pagedbatch.moderation import CATEGORIES

TEXTS = ["You are wonderful.", "I will find you.", "Recipes for a quiet evening at home."]


def assert_guard_idle(server) -> None:
    stats = server.embedded.guard.engine.get_stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


@pytest.fixture(scope="module")
def reference(make_checkpoint):
    """The classifier's scores per text, from transformers."""
    path = make_checkpoint("llama", task="classify")
    return path, dict(zip(TEXTS, classifier_scores(path, TEXTS), strict=True))


def test_scores_are_the_classifiers(serve_batches, reference):
    path, expected = reference
    server = serve_batches(moderation_model=str(path))
    client = server.client()
    answer = client.moderations.create(input=TEXTS, model="omni-moderation-latest")
    assert answer.id.startswith("modr-") and answer.model == path.name
    assert len(answer.results) == len(TEXTS)
    for text, result in zip(TEXTS, answer.results, strict=True):
        scores = result.category_scores.model_dump(by_alias=True)
        assert set(scores) == set(CATEGORIES)
        for category in CATEGORIES:
            assert scores[category] == pytest.approx(expected[text][category], abs=1e-4)
        flags = result.categories.model_dump(by_alias=True)
        assert flags == {c: expected[text][c] >= 0.5 for c in CATEGORIES}
        assert result.flagged == any(flags.values())
        applied = result.category_applied_input_types.model_dump(by_alias=True)
        assert applied == {c: ["text"] for c in CATEGORIES}
    # One string, a list of text parts (read as one input), and the guard's own name.
    one = client.moderations.create(input=TEXTS[1], model=path.name).results
    parts = [{"type": "text", "text": TEXTS[1]}]
    assert (
        client.moderations.create(input=parts).results[0].category_scores == one[0].category_scores
    )
    assert_guard_idle(server)


def test_the_threshold_decides_what_is_flagged(serve_batches, reference):
    path, expected = reference
    text = TEXTS[0]
    # The category scored nearest the middle: thresholds on either side of it are in [0, 1].
    category, score = min(expected[text].items(), key=lambda item: abs(item[1] - 0.5))
    below = serve_batches(moderation_model=str(path), safety_threshold=score - 1e-3).client()
    result = below.moderations.create(input=text).results[0]
    assert result.flagged and result.categories.model_dump(by_alias=True)[category]
    above = serve_batches(moderation_model=str(path), safety_threshold=score + 1e-3).client()
    result = above.moderations.create(input=text).results[0]
    assert not result.categories.model_dump(by_alias=True)[category]
    assert result.flagged == any(s >= score + 1e-3 for s in expected[text].values())


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": ["fine", "  "]}, 400, "input[1]"),
        ({"input": ["x"] * 5}, 400, "input"),
        ({"input": "x", "model": "someone-elses"}, 404, "model"),
        (
            {"input": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
            400,
            "input[0]",
        ),
        ({"input": "x", "stream": True}, 400, "stream"),
    ],
    ids=["empty", "no-inputs", "blank", "too-many", "unknown-model", "image", "unknown-field"],
)
def test_bad_input_is_refused(serve_batches, reference, body, status, param):
    path, _ = reference
    server = serve_batches(moderation_model=str(path), max_moderation_inputs=4)
    response = server.http().post("/v1/moderations", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert_guard_idle(server)


def test_without_a_moderation_model_the_endpoint_says_so(serve_batches):
    with pytest.raises(openai.NotFoundError) as caught:
        serve_batches().client().moderations.create(input="hello")
    assert "PAGEDBATCH_MODERATION_MODEL" in caught.value.body["message"]


def test_a_batch_of_moderations(serve_batches, reference):
    path, expected = reference

    def line(custom_id: str, given: object) -> dict:
        body = {"model": "omni-moderation-latest", "input": given}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/moderations", "body": body}

    server = serve_batches(moderation_model=str(path))
    client = server.client()
    lines = [line("one", TEXTS[0]), line("two", TEXTS[1:]), line("blank", "")]
    batch = finished(client, create(client, lines, endpoint="/v1/moderations").id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    output, errors = results(client, batch)
    by_id = {o["custom_id"]: o["response"]["body"] for o in output}
    scored = [r["category_scores"] for r in by_id["one"]["results"] + by_id["two"]["results"]]
    for text, scores in zip(TEXTS, scored, strict=True):
        assert scores == pytest.approx(expected[text], abs=1e-4)
    [blank] = errors
    assert blank["response"]["status_code"] == 400
    assert blank["response"]["body"]["error"]["param"] == "input"
    assert_guard_idle(server)


def test_moderation_batches_need_a_moderation_model(serve_batches):
    client = serve_batches().client()
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, [], endpoint="/v1/moderations")
    assert "PAGEDBATCH_MODERATION_MODEL" in caught.value.body["message"]


def test_a_generative_guard_serves_moderations_too(serve_batches, make_checkpoint):
    path = make_checkpoint("llama", task="guard")
    client = serve_batches(moderation_model=str(path), safety_threshold=0).client()
    [result] = client.moderations.create(input="Hello there").results
    scores = result.category_scores.model_dump(by_alias=True)
    # The codes it wrote name the categories that get its P("unsafe"); the others get 0.
    assert set(scores) == set(CATEGORIES) and all(0 <= s <= 1 for s in scores.values())
    assert len({s for s in scores.values() if s > 0}) <= 1
    # At threshold 0 every category is flagged, scored or not.
    assert result.flagged and all(result.categories.model_dump(by_alias=True).values())

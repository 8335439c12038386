"""`/v1/embeddings` through the unmodified `openai` SDK, on an embedding model served beside the
main one (PAGEDBATCH_EMBEDDING_MODEL): every input form gives the vectors the same texts give one
by one; base64 (the SDK's default, which it decodes) is the same float32 values as `float`; bad
input is a 400 naming its field that leaves the engines idle and the next request served; the
inputs' tokens are counted as embeddings usage and charged at the input price; a batch of
embedding lines gives the realtime vectors. The main model may be the embedding model; without
any, embedding batches are refused at create."""

from __future__ import annotations

import base64
import time

import numpy as np
import openai
import pytest
from servers import eventually
from test_batches import create, finished, results

TEXTS = ["The cat sat on the mat.", "A second, rather longer sentence about dogs.", "Short."]
ADMIN = "root"
PRICE = {"input": 2.0, "output": 8.0}


@pytest.fixture(scope="module")
def bert(make_checkpoint):
    return make_checkpoint("bert")


@pytest.fixture
def server(serve_batches, bert):
    return serve_batches(
        embedding_model=str(bert), admin_keys=ADMIN, prices={bert.name: PRICE}, batch_discount=0.5
    )


def assert_idle(server) -> None:
    """Neither engine holds a request (a refused one never reached them)."""
    for engine in (server.embedded.embedder, server.embedded.context.engine):
        stats = engine.engine.get_stats()
        assert stats["running"] == stats["waiting"] == 0


def vectors(answer) -> list[list[float]]:
    assert [item.index for item in answer.data] == list(range(len(answer.data)))
    return [item.embedding for item in answer.data]


def test_every_input_form_gives_the_same_vectors(server, bert):
    client = server.client()
    model = bert.name
    assert model in [m.id for m in client.models.list()]
    one_by_one = [vectors(client.embeddings.create(model=model, input=text))[0] for text in TEXTS]
    for vector in one_by_one:  # the model's Normalize module: unit vectors
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    assert len({tuple(v) for v in one_by_one}) == len(TEXTS)

    together = client.embeddings.create(model=model, input=TEXTS)
    assert together.model == model and together.object == "list"
    np.testing.assert_allclose(vectors(together), one_by_one, atol=1e-5)
    # The SDK asks for base64 unless told otherwise, and decodes it: the same floats as `float`.
    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert vectors(floats) == vectors(together)
    raw = client.embeddings.create(model=model, input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(v), "<f4").tolist() for v in vectors(raw)]
    assert decoded == vectors(floats)

    # Token ids: one list, or a list of them; the tokens the texts are tokenized into.
    tokenizer = server.embedded.embedder.engine.tokenizer
    ids = [tokenizer.encode(text, add_special_tokens=True) for text in TEXTS]
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
    np.testing.assert_allclose(vectors(by_ids), one_by_one, atol=1e-5)
    single = client.embeddings.create(model=model, input=ids[1], encoding_format="float")
    np.testing.assert_allclose(vectors(single), one_by_one[1:2], atol=1e-5)
    assert together.usage.prompt_tokens == together.usage.total_tokens == sum(map(len, ids))
    assert_idle(server)


BAD = {
    "empty": ({"input": ""}, "input"),
    "empty-among-many": ({"input": ["fine", ""]}, "input[1]"),
    "empty-token-list": ({"input": [[5], []]}, "input[1]"),
    "too-many": ({"input": ["x"] * 2049}, "input"),
    "outside-vocabulary": ({"input": [[5], [10**6]]}, "input[1]"),
    "too-long": ({"input": ["ok", "word " * 5000]}, "input[1]"),
    "dimensions": ({"input": "x", "dimensions": 4}, "dimensions"),
    "encoding": ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    "stream": ({"input": "x", "stream": True}, "stream"),
    "a-generating-model": ({"input": "x", "model": "tiny"}, "model"),
    # More than one client may run at once (a share of 0.5 of the embedder's 2,048).
    "too-many-sequences": ({"input": ["x"] * 1025}, "input"),
}


def test_bad_input_is_a_400_naming_the_field_and_disturbs_nothing(serve_batches, bert):
    server = serve_batches(embedding_model=str(bert), realtime_tenant_share=0.5)
    http = server.http()
    for case, (body, param) in BAD.items():
        response = http.post("/v1/embeddings", json={"model": bert.name, **body})
        assert response.status_code == 400, (case, response.text)
        assert response.json()["error"]["param"] == param, case
        assert_idle(server)
        fine = http.post("/v1/embeddings", json={"model": bert.name, "input": "still served"})
        assert fine.status_code == 200 and len(fine.json()["data"]) == 1
    # Nor does an embedding model generate.
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=bert.name, messages=[{"role": "user", "content": "Hi"}]
        )
    assert caught.value.body["param"] == "model"
    assert "is an embedding model" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=bert.name, prompt="Hi")
    assert caught.value.body["param"] == "model"
    assert_idle(server)


def test_a_batch_of_embeddings_gives_the_realtime_vectors_and_is_charged_as_input(server, bert):
    began = int(time.time())
    client = server.client()
    model = bert.name
    realtime = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": model, "input": text, **({"encoding_format": "base64"} if i else {})},
        }
        for i, text in enumerate(TEXTS)
    ]
    lines.append(
        {
            "custom_id": "empty",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": model, "input": ""},
        }
    )
    batch = finished(client, create(client, lines, endpoint="/v1/embeddings").id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    output, errors = results(client, batch)
    by_id = {line["custom_id"]: line["response"]["body"] for line in output}
    batched = []
    for i in range(len(TEXTS)):
        [item] = by_id[f"e{i}"]["data"]
        embedding = item["embedding"]
        if i:  # asked for base64
            embedding = np.frombuffer(base64.b64decode(embedding), "<f4").tolist()
        batched.append(embedding)
    np.testing.assert_allclose(batched, vectors(realtime), atol=1e-5)
    [empty] = errors
    assert empty["response"]["status_code"] == 400
    assert empty["response"]["body"]["error"]["param"] == "input"
    batch_tokens = sum(by_id[f"e{i}"]["usage"]["prompt_tokens"] for i in range(len(TEXTS)))
    assert batch.usage.input_tokens == batch_tokens and batch.usage.output_tokens == 0

    # The ledger: the inputs' tokens under the embedding model, as embeddings usage (none of it
    # in completions usage); priced as input, the batch's at the discount.
    admin = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", admin_api_key=ADMIN, max_retries=0
    )
    usage = admin.admin.organization.usage

    def counted() -> list:
        page = usage.embeddings(start_time=began, group_by=["model"])
        return [
            (r.model, r.input_tokens, r.num_model_requests) for b in page.data for r in b.results
        ]

    # A realtime request is one record, whatever its inputs; each batch line is one.
    tokens = realtime.usage.prompt_tokens + batch_tokens
    eventually(lambda: counted() == [(model, tokens, 1 + 3)], timeout=10)
    [result] = [r for b in usage.embeddings(start_time=began).data for r in b.results]
    assert result.object == "organization.usage.embeddings.result"
    assert (result.input_tokens, result.model) == (tokens, None)
    completions = usage.completions(start_time=began, models=[model])
    assert [r for b in completions.data for r in b.results] == []
    page = usage.costs(start_time=began, group_by=["line_item"])
    items = {r.line_item: r.amount.value for b in page.data for r in b.results}
    assert items == pytest.approx(
        {
            f"{model}, input": realtime.usage.prompt_tokens * PRICE["input"] / 1e6,
            f"{model}, input (batch)": batch_tokens * PRICE["input"] * 0.5 / 1e6,
        }
    )


def test_the_main_model_may_be_the_embedding_model(serve_batches, bert):
    server = serve_batches(model=str(bert), served_model_name="minilm")
    client = server.client()
    assert [m.id for m in client.models.list()] == ["minilm"]
    [item] = client.embeddings.create(model="minilm", input="Hello").data
    assert len(item.embedding) == server.embedded.context.engine.engine.pooling.dimensions
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["param"] == "model"
    # Its batches are taken, and held to OpenAI's 50,000 inputs across their lines.
    line = {"method": "POST", "url": "/v1/embeddings", "body": {"model": "minilm"}}
    lines = [
        {**line, "custom_id": f"e{i}", "body": {**line["body"], "input": [[5]] * 2048}}
        for i in range(25)
    ]
    batch = finished(client, create(client, lines, endpoint="/v1/embeddings").id)
    assert batch.status == "failed"
    assert [(e.code, e.line, e.param) for e in batch.errors.data] == [
        ("too_many_inputs", 25, "body.input")
    ]


def test_without_an_embedding_model_embedding_batches_are_refused(serve_batches):
    client = serve_batches().client()
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, [], endpoint="/v1/embeddings")
    assert caught.value.body["param"] == "endpoint"
    assert "PAGEDBATCH_EMBEDDING_MODEL" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="tiny", input="Hello")
    assert caught.value.body["param"] == "model"

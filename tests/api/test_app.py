"""What every endpoint shares: OpenAI-shaped errors, request ids, health and models."""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest

from pagedbatch.engine import SamplingParams

ERROR_FIELDS = {"message", "type", "param", "code"}


def test_health(server):
    with server.http() as http:
        response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


class EngineBug(BaseException):
    """Not an Exception: what no request's own failure handling catches, as a bug would be."""


def test_health_is_a_503_saying_why_once_the_engine_has_died(serve_batches):
    server = serve_batches()
    engine = server.embedded.context.engine

    def bug(_ids, _row):
        raise EngineBug("a step went wrong")

    async def run_into_the_bug() -> None:
        params = SamplingParams(max_tokens=2, logits_processors=[bug])
        with pytest.raises(Exception, match="engine has stopped"):
            async for _ in engine.generate("hello", params):
                pass

    with server.http() as http:
        assert http.get("/health").status_code == 200
        asyncio.run(run_into_the_bug())
        response = http.get("/health")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["error"]["code"] == "engine_dead"
    assert "a step went wrong" in body["error"]["message"]


def test_health_is_a_503_once_the_embedding_models_engine_has_died(serve_batches, make_checkpoint):
    bert = make_checkpoint("bert")
    server = serve_batches(embedding_model=str(bert))
    embedder = server.embedded.context.embedder

    def bug(*_args, **_kwargs):
        raise EngineBug("an encoder step went wrong")

    embedder.engine.runner.model.forward = bug  # the next step dies of it
    with server.http() as http:
        assert http.get("/health").status_code == 200
        response = http.post("/v1/embeddings", json={"model": bert.name, "input": "hello"})
        assert response.status_code >= 500
        response = http.get("/health")
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert f"{bert.name}'s engine died" in message and "an encoder step went wrong" in message


def test_each_response_carries_a_new_request_id(server):
    with server.http() as http:
        ids = {http.get("/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3
    assert all(request_id.startswith("req_") for request_id in ids)


def test_a_client_request_id_is_logged_beside_ours_not_taken(server, caplog):
    caplog.set_level(logging.INFO, logger="pagedbatch.api.app")
    with server.http() as http:
        # Another request's id, which a client must not be able to make ours.
        taken = http.get("/health").headers["x-request-id"]
        response = http.get("/v1/files", headers={"x-request-id": taken})
    ours = response.headers["x-request-id"]
    assert ours.startswith("req_") and ours != taken
    [line] = [r.getMessage() for r in caplog.records if taken in r.getMessage()]
    assert ours in line


def test_errors_report_the_request_id_to_the_sdk(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().files.retrieve("file-missing")
    assert caught.value.request_id.startswith("req_")


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/v1/nothing-here", 404, "unknown_url"),
        ("GET", "/nothing-here", 404, "unknown_url"),
        ("PUT", "/v1/files", 405, "method_not_allowed"),
    ],
)
def test_routing_errors_are_openai_shaped(server, method, path, status, code):
    with server.http() as http:
        response = http.request(method, path)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    assert response.headers["x-request-id"]


def test_a_bad_parameter_is_a_400_naming_it_not_a_422(server):
    with server.http() as http:
        response = http.get("/v1/files", params={"limit": "many"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS
    assert (error["param"], error["code"]) == ("limit", "invalid_value")


def test_an_over_long_idempotency_key_is_refused(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().files.create(
            file=("a.jsonl", b"{}\n"), purpose="batch", extra_headers={"Idempotency-Key": "k" * 300}
        )
    assert caught.value.param == "idempotency-key"


def test_an_unexpected_failure_is_a_500_server_error(serve):
    def fail() -> None:
        raise RuntimeError("secret internals")

    server = serve(customize=lambda app: app.add_api_route("/v1/fail", fail))
    with server.http() as http:
        response = http.get("/v1/fail")
    assert response.status_code == 500
    assert response.headers["x-request-id"].startswith("req_")
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS
    assert error["type"] == "server_error"
    assert "secret" not in error["message"]


def test_models_lists_the_served_models(serve):
    client = serve(served_models=["tiny-llama", "org/tiny-qwen"]).client()
    models = list(client.models.list())
    assert [m.id for m in models] == ["tiny-llama", "org/tiny-qwen"]
    assert all(m.object == "model" and m.owned_by == "pagedbatch" for m in models)
    assert client.models.retrieve("org/tiny-qwen").id == "org/tiny-qwen"


def test_an_unknown_model_is_a_404(serve):
    client = serve(served_models=["tiny-llama"]).client()
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert (caught.value.param, caught.value.code) == ("model", "model_not_found")


def test_the_openapi_document_renders(server):
    with server.http() as http:
        document = http.get("/openapi.json").json()
    assert {"/v1/files", "/v1/files/{file_id}/content", "/v1/models", "/health"} <= set(
        document["paths"]
    )
    assert "multipart/form-data" in document["paths"]["/v1/files"]["post"]["requestBody"]["content"]

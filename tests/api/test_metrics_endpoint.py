"""`/metrics` on the embedded service: a scrape before and after a realtime request and a batch
whose lines share a prompt prefix shows the engine, service and HTTP figures moved by exactly
what was done, in an exposition prometheus-client's own parser reads; and the Grafana dashboard
(deploy/grafana) queries only series that scrape holds."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from servers import API_KEYS, BatchServer
from sqlalchemy import event
from test_batches import chat_line, create, finished, read_lines
from test_deploy import dashboard_metric_names

pytestmark = pytest.mark.parametrize("storage", ["embedded"], indirect=True)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# Long enough to fill several 16-token KV blocks, which later requests find in the prefix cache.
SYSTEM = "You are a careful assistant. " * 12
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]


def scrape(http: httpx.Client) -> Samples:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample's value; 0 for a labelled series not created yet."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every series of `name` that has `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, found), v in samples.items() if n == name and wanted <= found)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_a_scrape_shows_what_a_realtime_request_and_a_batch_did(serve_batches):
    server: BatchServer = serve_batches(metrics_cache_seconds=0)  # each scrape reads the store
    client = server.client()
    with server.http() as http:
        before = scrape(http)

        answer = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=5, extra_body={"ignore_eos": True}
        )
        lines = [
            chat_line(
                f"line-{i}",
                max_tokens=3 + i,
                ignore_eos=True,
                messages=[MESSAGES[0], {"role": "user", "content": f"Question {i}"}],
            )
            for i in range(3)
        ]
        batch = finished(client, create(client, lines).id)
        assert batch.status == "completed"
        bodies = [line["response"]["body"] for line in read_lines(client, batch.output_file_id)]
        assert http.get("/no/such/path").status_code == 404

        after = scrape(http)

    usages = [answer.usage.model_dump()] + [body["usage"] for body in bodies]
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    model = {"model_name": "tiny"}

    # The engine: tokens, requests and the shared prefix found in the cache.
    assert moved(before, after, "pagedbatch:prompt_tokens_total", **model) == prompt
    assert moved(before, after, "pagedbatch:generation_tokens_total", **model) == completion
    assert completion == 5 + 3 + 4 + 5
    assert (
        total(after, "pagedbatch:request_success_total", **model)
        - total(before, "pagedbatch:request_success_total", **model)
        == 4
    )
    assert moved(before, after, "pagedbatch:prefix_cache_queries_total", **model) == prompt
    assert moved(before, after, "pagedbatch:prefix_cache_hits_total", **model) == cached
    # Every batch line found at least the system prompt's full blocks, cached by the request.
    assert all(body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48 for body in bodies)
    assert moved(before, after, "pagedbatch:e2e_request_latency_seconds_count", **model) == 4
    assert value(after, "pagedbatch:num_requests_running", **model) == 0
    assert value(after, "pagedbatch:kv_cache_usage_perc", **model) == 0

    # The service: the batch, its requests and its files.
    assert moved(before, after, "pagedbatch:batch_requests_total", status="completed") == 3
    assert moved(before, after, "pagedbatch:batch_requests_total", status="failed") == 0
    assert value(after, "pagedbatch:batches", status="completed") == 1
    assert value(after, "pagedbatch:batches", status="in_progress") == 0
    assert value(after, "pagedbatch:files", purpose="batch") == 1
    assert (
        value(after, "pagedbatch:file_bytes", purpose="batch")
        == client.files.retrieve(batch.input_file_id).bytes
    )
    assert value(after, "pagedbatch:files", purpose="batch_output") == 1
    assert value(after, "pagedbatch:webhook_deliveries", outcome="delivered") == 0
    assert value(after, "pagedbatch:queue_depth", queue="run_shard") == 0
    assert value(after, "pagedbatch:queue_depth", queue="default") == 0

    # HTTP: by route template, never by raw path.
    chat = {"method": "POST", "route": "/v1/chat/completions"}
    assert moved(before, after, "pagedbatch:http_requests_total", **chat, status="200") == 1
    assert moved(before, after, "pagedbatch:http_request_duration_seconds_count", **chat) == 1
    polls = {"method": "GET", "route": "/v1/batches/{batch_id}", "status": "200"}
    assert moved(before, after, "pagedbatch:http_requests_total", **polls) >= 1
    unmatched = {"method": "GET", "route": "unmatched", "status": "404"}
    assert moved(before, after, "pagedbatch:http_requests_total", **unmatched) == 1
    routes = {
        dict(labels)["route"] for name, labels in after if name.startswith("pagedbatch:http_")
    }
    assert not [route for route in routes if batch.id in route]

    # Every series the dashboard queries is one this process exports.
    exported = {name for name, _ in after}
    assert dashboard_metric_names() <= exported, dashboard_metric_names() - exported


# Who may scrape, and what a scrape costs.


def test_with_api_keys_metrics_need_their_own_token(serve):
    server = serve(api_keys=API_KEYS, metrics_token="scraper-secret")
    for key in (None, API_KEYS[0], "wrong"):  # a tenant's key shows no one else's figures
        with server.http(key) as http:
            response = http.get("/metrics")
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_metrics_token"
    with server.http("scraper-secret") as http:
        assert "pagedbatch:batches" in http.get("/metrics").text


def test_with_api_keys_and_no_metrics_token_metrics_are_refused_saying_why(serve):
    server = serve(api_keys=API_KEYS)
    with server.http(API_KEYS[0]) as http:
        response = http.get("/metrics")
    assert response.status_code == 403
    assert "PAGEDBATCH_METRICS_TOKEN" in response.json()["error"]["message"]


def test_without_api_keys_metrics_are_open(server):
    with server.http() as http:
        assert http.get("/metrics").status_code == 200


@pytest.mark.parametrize(("cache_seconds", "queried"), [(60, False), (0, True)])
def test_scrapes_within_the_cache_time_do_not_query_the_store(serve, cache_seconds, queried):
    statements: list[str] = []

    def count_statements(app: FastAPI) -> None:
        engine = app.state.services.session_factory.kw["bind"]
        event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))

    server = serve(customize=count_statements, metrics_cache_seconds=cache_seconds)
    with server.http() as http:
        scrape(http)
        statements.clear()
        samples = scrape(http)
    assert bool(statements) is queried
    assert value(samples, "pagedbatch:batches", status="completed") == 0

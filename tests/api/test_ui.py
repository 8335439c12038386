"""The status page's server side: the static page at `/ui` and the engine figures it shows,
`GET /v1/engine/stats`. (tests/api/test_ui_browser.py runs the page itself in a browser.)"""

from __future__ import annotations

import time

import pytest

from pagedbatch.api.routes.engine import STATS_TIMEOUT_SECONDS


@pytest.mark.parametrize(
    ("path", "content_type", "holds"),
    [
        ("/ui", "text/html", '<script src="ui/ui.js"'),
        ("/ui/ui.js", "text/javascript", "v1/engine/stats"),
        ("/ui/ui.css", "text/css", "progress"),
    ],
)
def test_the_page_and_its_assets_need_no_key(auth_server, path, content_type, holds):
    with auth_server.http() as http:
        response = http.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(content_type)
    assert holds in response.text
    # Nothing but the page's own files and API: what it renders from the API cannot run code.
    policy = response.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy
    assert response.headers["x-content-type-options"] == "nosniff"


def test_an_unknown_asset_is_an_openai_shaped_404(auth_server):
    with auth_server.http() as http:
        response = http.get("/ui/secrets.txt")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "unknown_url"


def test_the_page_stays_out_of_the_openapi_document(auth_server):
    with auth_server.http() as http:
        paths = http.get("/openapi.json").json()["paths"]
    assert "/v1/engine/stats" in paths
    assert not [path for path in paths if path.startswith("/ui")]


def test_engine_stats_need_a_key(auth_server):
    with auth_server.http() as http:
        response = http.get("/v1/engine/stats")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_an_api_without_an_engine_says_its_figures_are_unavailable(auth_server):
    with auth_server.http("k1") as http:
        stats = http.get("/v1/engine/stats").json()
    assert stats == {"object": "engine.stats", "available": False, "engines": []}


def test_the_embedded_engine_reports_its_load_and_rate(serve_batches):
    server = serve_batches()
    client = server.client()
    with server.http() as http:
        first = http.get("/v1/engine/stats").json()
        assert first["available"] is True
        [engine] = first["engines"]
        assert engine.pop("settings")["served_model_name"] == "tiny"  # test_engine_settings.py
        assert engine.pop("resident")["kv_cache_bytes"] > 0  # test_engine_stats.py
        assert engine == {
            "id": "embedded",
            "model": "tiny",
            "running": 0,
            "waiting": 0,
            "kv_usage": 0.0,
            "tokens_per_second": None,  # one reading gives no rate
        }
        started = time.monotonic()
        client.completions.create(
            model="tiny", prompt="Hi", max_tokens=16, extra_body={"ignore_eos": True}
        )
        generating = time.monotonic() - started
        [engine] = http.get("/v1/engine/stats").json()["engines"]
    assert engine["running"] == engine["waiting"] == 0
    # 16 tokens between the two readings, which lie further apart than the request took.
    assert 0 < engine["tokens_per_second"] <= 16 / generating


def test_while_generating_the_engine_shows_running_requests_and_kv_in_use(serve_batches):
    server = serve_batches()
    client = server.client()
    with (
        server.http() as http,
        client.completions.with_streaming_response.create(
            model="tiny", prompt="Hi", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        ) as stream,
    ):
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # the request is in the engine
        [engine] = http.get("/v1/engine/stats").json()["engines"]
    assert engine["running"] == 1
    assert 0 < engine["kv_usage"] < 1


def test_a_stopped_engine_is_reported_unavailable(serve_batches):
    server = serve_batches()
    server.embedded.context.engine.shutdown()
    with server.http() as http:
        started = time.monotonic()
        stats = http.get("/v1/engine/stats").json()
    assert stats == {"object": "engine.stats", "available": False, "engines": []}
    assert time.monotonic() - started < STATS_TIMEOUT_SECONDS + 1

"""What a web page in the user's browser cannot make a keyless server do (api/web_guard.py): a
DNS-rebinding page's Host is refused (400), a cross-site page's request is refused (403) unless
its origin is configured, and a body that is not what its route takes is refused (415). The SDK,
the status page and configured hosts and origins go on working."""

from __future__ import annotations

import json

import httpx
import pytest
from servers import BatchServer, Server

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
EVIL_ORIGIN = "http://rebind.evil.example:8000"
APP_ORIGIN = "https://app.example.com"


def batch_file(server: Server, lines: int = 1, max_tokens: int = 2) -> str:
    body = {**CHAT, "max_tokens": max_tokens, "ignore_eos": True}
    text = "\n".join(
        json.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
        for i in range(lines)
    )
    upload = server.client().files.create(file=("in.jsonl", text.encode()), purpose="batch")
    return upload.id


def error(response: httpx.Response) -> dict:
    return response.json()["error"]


@pytest.fixture
def batch_server(serve_batches) -> BatchServer:
    return serve_batches()


def test_a_dns_rebinding_page_is_refused_and_changes_nothing(batch_server):
    with batch_server.http() as http:
        response = http.post(
            "/v1/chat/completions", json=CHAT, headers={"host": "rebind.evil.example:8000"}
        )
        assert response.status_code == 400
        assert error(response)["code"] == "invalid_host"
        assert response.headers["x-request-id"].startswith("req_")
        upload = http.post(
            "/v1/files",
            files={"file": ("in.jsonl", b"{}")},
            data={"purpose": "batch"},
            headers={"host": "rebind.evil.example"},
        )
        assert upload.status_code == 400
        assert http.get("/v1/files").json()["data"] == []
    assert batch_server.blob_keys() == []


def test_a_cross_site_text_plain_post_carrying_json_is_refused(batch_server):
    with batch_server.http() as http:
        for origin in ({}, {"origin": "https://evil.example"}):
            response = http.post(
                "/v1/chat/completions",
                content=json.dumps(CHAT),
                headers={"content-type": "text/plain", **origin},
            )
            assert response.status_code in (403, 415)
        # Without an Origin header (a no-cors fetch from a page that hides it), the content type
        # alone refuses it.
        response = http.post(
            "/v1/chat/completions", content=json.dumps(CHAT), headers={"content-type": "text/plain"}
        )
        assert response.status_code == 415
        assert error(response)["code"] == "unsupported_media_type"
        assert "application/json" in error(response)["message"]
        unlabelled = http.post("/v1/chat/completions", content=json.dumps(CHAT))
        assert unlabelled.status_code == 415


def test_a_cross_origin_multipart_upload_is_refused_and_stores_nothing(batch_server):
    with batch_server.http() as http:
        response = http.post(
            "/v1/files",
            files={"file": ("in.jsonl", b'{"custom_id": "a"}')},
            data={"purpose": "batch"},
            headers={"origin": "https://evil.example"},
        )
        assert response.status_code == 403
        assert error(response)["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in response.headers
        assert http.get("/v1/files").json()["data"] == []
    assert batch_server.blob_keys() == []


def test_a_cross_origin_batch_cancel_is_refused(batch_server):
    client = batch_server.client()
    batch = client.batches.create(
        input_file_id=batch_file(batch_server),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    with batch_server.http() as http:
        # What a cross-site <form method=post> sends: no body, the page's origin.
        response = http.post(f"/v1/batches/{batch.id}/cancel", headers={"origin": "null"})
    assert response.status_code == 403
    assert client.batches.retrieve(batch.id).status not in ("cancelling", "cancelled")


def test_the_sdk_works_as_before(batch_server):
    client = batch_server.client()
    answer = client.chat.completions.create(**CHAT)
    assert answer.choices[0].message.content is not None
    # 45,000 tokens: still running when it is cancelled, however fast the CPU (a Zen 5 EPYC
    # finished a one-line batch first).
    input_file_id = batch_file(batch_server, lines=30, max_tokens=1500)
    batch = client.batches.create(
        input_file_id=input_file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    client.batches.cancel(batch.id)  # a POST without a body
    assert input_file_id in [f.id for f in client.files.list()]


def test_the_servers_own_page_and_localhost_names_are_answered(server):
    port = httpx.URL(server.url).port
    with server.http() as http:
        for host in (f"localhost:{port}", "localhost", f"[::1]:{port}", "127.0.0.1", "127.0.0.2"):
            assert http.get("/v1/files", headers={"host": host}).status_code == 200, host
        # The status page's requests carry its own origin.
        own = http.get("/v1/files", headers={"origin": server.url})
        assert own.status_code == 200
        assert "access-control-allow-origin" not in own.headers
        json_with_charset = http.post(
            "/v1/organization/spend_limit",
            content=b'{"currency": "USD", "interval": "month", "threshold_amount": 100}',
            headers={"content-type": "application/json; charset=utf-8", "origin": server.url},
        )
        assert json_with_charset.status_code == 200


def test_health_and_metrics_answer_any_host(server):
    with server.http() as http:
        for path in ("/health", "/metrics"):
            assert http.get(path, headers={"host": "api:8000"}).status_code == 200
        assert http.get("/v1/models", headers={"host": "api:8000"}).status_code == 400


def test_configured_host_names_and_the_bound_name_are_answered(serve):
    server = serve(host="pagedbatch-api", allowed_hosts="api.example.com, LB.internal")
    with server.http() as http:
        for host in ("api.example.com", "lb.internal:443", "pagedbatch-api:8000", "localhost"):
            assert http.get("/v1/files", headers={"host": host}).status_code == 200, host
        refused = http.get("/v1/files", headers={"host": "other.example.com"})
        assert refused.status_code == 400
        assert http.get("/v1/files", headers={"host": "api.example.com:x"}).status_code == 400


def test_a_server_bound_to_every_interface_answers_only_names_it_was_given(serve):
    server = serve(host="0.0.0.0")
    with server.http() as http:
        assert http.get("/v1/files", headers={"host": "0.0.0.0:8000"}).status_code == 400
        assert http.get("/v1/files", headers={"host": "192.168.1.5:8000"}).status_code == 400
        assert http.get("/v1/files", headers={"host": "localhost:8000"}).status_code == 200


def test_a_configured_origin_gets_cors_answers_and_preflights(serve):
    server = serve(cors_origins=f"{APP_ORIGIN}/")
    with server.http() as http:
        preflight = http.options(
            "/v1/files",
            headers={
                "origin": APP_ORIGIN,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type, idempotency-key",
            },
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == APP_ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "idempotency-key" in preflight.headers["access-control-allow-headers"]
        assert "origin" in preflight.headers["vary"].lower()
        answer = http.get("/v1/files", headers={"origin": APP_ORIGIN})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == APP_ORIGIN
        assert "x-request-id" in answer.headers["access-control-expose-headers"]
        refused = http.options(
            "/v1/files",
            headers={"origin": "https://evil.example", "access-control-request-method": "POST"},
        )
        assert refused.status_code == 403
        assert "access-control-allow-origin" not in refused.headers


def test_any_origin_when_configured_so(serve):
    server = serve(cors_origins="*")
    with server.http() as http:
        answer = http.get("/v1/files", headers={"origin": "https://anywhere.example"})
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == "https://anywhere.example"


def test_a_form_route_takes_only_a_form(server):
    with server.http() as http:
        response = http.post("/v1/files", json={"purpose": "batch"})
        assert response.status_code == 415
        assert "multipart/form-data" in error(response)["message"]
        transcription = http.post(
            "/v1/audio/transcriptions", content=b"x", headers={"content-type": "audio/wav"}
        )
        assert transcription.status_code == 415

"""`/v1/webhook_endpoints`: registering, listing, rotating and deleting endpoints, each tenant
its own, and refusing URLs that lead into the deployment. On both stores."""

from __future__ import annotations

import base64

import httpx
import pytest
from servers import API_KEYS, STORAGES

pytestmark = pytest.mark.parametrize("storage", STORAGES, indirect=True)

HOOK = "http://127.0.0.1:9/hook"  # nothing listens: registration does not call the URL
LOOPBACK_ALLOWED = {"webhook_allowed_hosts": ["127.0.0.1"]}


def create(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/webhook_endpoints", json={"url": HOOK, **body})
    assert response.status_code == 200, response.text
    return response.json()


def error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_an_endpoint_shows_its_secret_on_creation_only(serve):
    http = serve(**LOOPBACK_ALLOWED).http()
    endpoint = create(http)
    assert endpoint["id"].startswith("whep_") and endpoint["object"] == "webhook_endpoint"
    assert endpoint["url"] == HOOK and endpoint["events"] is None
    assert endpoint["status"] == "enabled" and endpoint["disabled_reason"] is None
    # Standard Webhooks' form, the one the openai SDK and `standardwebhooks` decode alike.
    prefix, _, key = endpoint["secret"].partition("_")
    assert prefix == "whsec" and len(base64.b64decode(key, validate=True)) == 32

    shown = http.get(f"/v1/webhook_endpoints/{endpoint['id']}").json()
    assert shown == {k: v for k, v in endpoint.items() if k != "secret"}
    [listed] = http.get("/v1/webhook_endpoints").json()["data"]
    assert listed == shown


def test_an_event_filter_takes_only_batch_event_types(serve):
    http = serve(**LOOPBACK_ALLOWED).http()
    endpoint = create(http, events=["batch.failed", "batch.expired"])
    assert endpoint["events"] == ["batch.failed", "batch.expired"]

    bad = http.post("/v1/webhook_endpoints", json={"url": HOOK, "events": ["file.created"]})
    assert error(bad)["param"] == "events[0]"
    empty = http.post("/v1/webhook_endpoints", json={"url": HOOK, "events": []})
    assert error(empty)["param"] == "events"
    missing = http.post("/v1/webhook_endpoints", json={"events": None})
    assert error(missing)["code"] == "missing_required_parameter"
    unknown = http.post("/v1/webhook_endpoints", json={"url": HOOK, "secret": "mine"})
    assert error(unknown)["code"] == "unknown_parameter"
    assert len(http.get("/v1/webhook_endpoints").json()["data"]) == 1


def test_rotating_returns_a_new_secret_once(serve):
    http = serve(**LOOPBACK_ALLOWED).http()
    endpoint = create(http)
    rotated = http.post(f"/v1/webhook_endpoints/{endpoint['id']}/rotate_secret").json()
    assert rotated["id"] == endpoint["id"]
    assert rotated["secret"].startswith("whsec_") and rotated["secret"] != endpoint["secret"]
    assert "secret" not in http.get(f"/v1/webhook_endpoints/{endpoint['id']}").json()


def test_a_deleted_endpoint_is_gone(serve):
    http = serve(**LOOPBACK_ALLOWED).http()
    endpoint = create(http)
    path = f"/v1/webhook_endpoints/{endpoint['id']}"
    assert http.delete(path).json() == {
        "id": endpoint["id"],
        "object": "webhook_endpoint",
        "deleted": True,
    }
    assert error(http.get(path), 404)["code"] == "not_found"
    assert error(http.delete(path), 404)["code"] == "not_found"
    assert http.get("/v1/webhook_endpoints").json()["data"] == []


REFUSED = [
    ("http://127.0.0.1:8080/hook", "127.0.0.1 is a loopback address"),
    ("http://[::1]/hook", "::1 is a loopback address"),
    ("http://10.0.0.7/hook", "10.0.0.7 is a private address"),
    ("http://169.254.169.254/latest/meta-data", "169.254.169.254 is a cloud metadata address"),
    ("http://[fe80::1]/hook", "fe80::1 is a link-local address"),
    # IPv6 forms that reach an IPv4 address: NAT64, 6to4, IPv4-compatible.
    ("http://[64:ff9b::a9fe:a9fe]/hook", "64:ff9b::a9fe:a9fe is a cloud metadata address"),
    ("http://[2002:a00:1::1]/hook", "2002:a00:1::1 is a private address"),
    ("http://[::a9fe:a9fe]/hook", "::a9fe:a9fe is a cloud metadata address"),
    ("ftp://example.com/hook", "the URL must start with https:// or http://"),
    ("https://8.8.8.8:0/hook", "the URL's port is not a valid port number"),
]


def test_urls_into_the_deployment_are_refused_with_a_clear_400(serve):
    http = serve().http()
    for url, reason in REFUSED:
        refused = error(http.post("/v1/webhook_endpoints", json={"url": url}))
        assert refused["param"] == "url" and refused["code"] == "invalid_value"
        assert refused["type"] == "invalid_request_error"
        assert refused["message"].startswith(f"Invalid value for 'url': {reason}"), url
    assert http.get("/v1/webhook_endpoints").json()["data"] == []


def test_the_allow_list_admits_only_what_it_names(serve):
    http = serve(webhook_allowed_hosts=["127.0.0.1"]).http()
    create(http)
    metadata = http.post("/v1/webhook_endpoints", json={"url": "http://169.254.169.254/"})
    assert error(metadata)["param"] == "url"


def test_each_tenant_sees_and_changes_only_its_own_endpoints(serve):
    server = serve(api_keys=API_KEYS, **LOOPBACK_ALLOWED)
    mine, theirs = server.http(API_KEYS[0]), server.http(API_KEYS[1])
    endpoint = create(mine)
    path = f"/v1/webhook_endpoints/{endpoint['id']}"

    assert theirs.get("/v1/webhook_endpoints").json()["data"] == []
    for response in (
        theirs.get(path),
        theirs.post(f"{path}/rotate_secret"),
        theirs.get(f"{path}/deliveries"),
        theirs.delete(path),
    ):
        assert error(response, 404)["code"] == "not_found"
    assert mine.get(path).json()["status"] == "enabled"
    assert error(server.http().get("/v1/webhook_endpoints"), 401)["code"] == "invalid_api_key"


def test_endpoints_list_newest_first_in_pages(serve):
    http = serve(**LOOPBACK_ALLOWED).http()
    ids = [create(http)["id"] for _ in range(3)]
    first = http.get("/v1/webhook_endpoints", params={"limit": 2}).json()
    assert [e["id"] for e in first["data"]] == ids[:0:-1] and first["has_more"]
    rest = http.get("/v1/webhook_endpoints", params={"limit": 2, "after": first["last_id"]}).json()
    assert [e["id"] for e in rest["data"]] == ids[:1] and not rest["has_more"]
    assert http.get(f"/v1/webhook_endpoints/{ids[0]}/deliveries").json()["data"] == []


def test_a_tenant_may_register_only_so_many_endpoints(serve):
    server = serve(api_keys=API_KEYS, webhook_max_endpoints_per_tenant=2, **LOOPBACK_ALLOWED)
    mine, theirs = server.http(API_KEYS[0]), server.http(API_KEYS[1])
    first, _ = create(mine), create(mine)
    refused = error(mine.post("/v1/webhook_endpoints", json={"url": HOOK}))
    assert refused["code"] == "too_many_endpoints" and refused["param"] is None
    assert "the most allowed is 2" in refused["message"]
    assert len(mine.get("/v1/webhook_endpoints").json()["data"]) == 2
    create(theirs)  # the limit is each tenant's
    mine.delete(f"/v1/webhook_endpoints/{first['id']}")
    create(mine)

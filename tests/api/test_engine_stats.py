"""Who sees what of `/v1/engine/stats` (api/routes/engine.py): every caller the load figures; the
settings in force, with the model's path on disk, only an admin key, or anyone while the service
has no keys (its one user runs it). (tests/api/test_ui.py checks the figures themselves.)"""

from __future__ import annotations

import httpx

LOAD = {"id", "model", "running", "waiting", "kv_usage", "tokens_per_second", "resident"}


def stats(url: str, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/v1/engine/stats", headers=headers, timeout=60)


def test_a_tenant_sees_load_figures_but_no_settings_nor_paths(serve_batches, tiny_llama):
    server = serve_batches(api_keys=["k1"], admin_keys=["root"])
    response = stats(server.url, "k1")
    assert response.status_code == 200
    [engine] = response.json()["engines"]
    assert engine["settings"] is None
    assert set(engine) == LOAD | {"settings"}
    # The model's resident size is a load figure, fixed at start.
    resident = server.embedded.context.engine.engine.resident
    assert engine["resident"] == resident.as_dict() and resident.kv_cache_bytes > 0
    assert str(tiny_llama) not in response.text


def test_an_admin_key_sees_the_settings_in_force(serve_batches, tiny_llama):
    server = serve_batches(api_keys=["k1"], admin_keys=["root"])
    response = stats(server.url, "root")
    assert response.status_code == 200
    [engine] = response.json()["engines"]
    assert engine["settings"]["model"] == str(tiny_llama)
    assert stats(server.url, "nobody").status_code == 401
    assert stats(server.url).status_code == 401


def test_without_keys_the_one_user_sees_the_settings(serve_batches, tiny_llama):
    [engine] = stats(serve_batches().url).json()["engines"]
    assert engine["settings"]["model"] == str(tiny_llama)


def test_with_admin_keys_alone_an_anonymous_caller_sees_no_settings(serve_batches):
    server = serve_batches(admin_keys=["root"])
    [engine] = stats(server.url).json()["engines"]
    assert engine["settings"] is None
    [engine] = stats(server.url, "root").json()["engines"]
    assert engine["settings"] is not None

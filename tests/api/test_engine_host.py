"""The engine host and the API's way to it, in one process on the real Redis: a host registers
while it runs and drops out when it stops; the API routes to the least loaded live host serving
the model, passes over one that is gone, and passes the host's answers (429s included) through.
The same with real worker processes is in test_distributed.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from redis.asyncio import Redis as AsyncRedis
from servers import engine_records, eventually

from pagedbatch.api.deps import Services
from pagedbatch.api.engine_host import EngineHost
from pagedbatch.api.engine_proxy import rank
from pagedbatch.engine import AsyncLLM
from pagedbatch.protocol.safety import BLOCKLIST, CONTENT_FILTERED
from pagedbatch.service import api_only, open_store
from pagedbatch.settings import Settings
from pagedbatch.store.engine_registry import EngineRecord, publish

HEARTBEAT = 0.2
SECRET = "s3cret"
DEAD = "http://127.0.0.1:9"  # nothing listens there: a host that died a moment ago
LONG = {"max_tokens": 1500, "ignore_eos": True}  # still running when the test acts on it


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}


def record(engine_id: str, **fields: Any) -> EngineRecord:
    defaults: dict[str, Any] = dict(
        address=f"http://{engine_id}:1",
        model="tiny",
        running=0,
        waiting=0,
        kv_usage=0.0,
        admitted=0,
        max_admitted=256,
        beat=1,
    )
    return EngineRecord(id=engine_id, **{**defaults, **fields})


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(str(tiny_llama), served_model_name="tiny", num_kv_blocks=128)
    yield llm
    llm.shutdown()


@pytest.fixture
def settings(tmp_path: Path, redis_url: str, tiny_llama: Path) -> Settings:
    return Settings(
        data_dir=tmp_path / "data",
        broker_url=redis_url,
        model=str(tiny_llama),
        served_model_name="tiny",
        engine_heartbeat_seconds=HEARTBEAT,
    )


def worker_services(
    settings: Settings, engine: AsyncLLM, guard: AsyncLLM | None = None
) -> Services:
    session_factory, blobs = open_store(settings)
    return Services(
        settings=settings,
        session_factory=session_factory,
        blobs=blobs,
        engine=engine,
        guard=guard,
    )


@pytest.fixture
def start_host(engine: AsyncLLM) -> Iterator[Callable[..., EngineHost]]:
    """`start_host(settings, worker_id, guard=None)`: a started engine host of a worker on
    `engine` (and `guard`, its moderation model)."""
    with ExitStack() as stack:

        def start(
            settings: Settings, worker_id: str = "worker-1", guard: AsyncLLM | None = None
        ) -> EngineHost:
            host = EngineHost(worker_services(settings, engine, guard), worker_id)
            host.start()
            stack.callback(host.stop)
            return host

        yield start


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` served by uvicorn in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually(lambda: server.started, timeout=30)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def load(host: EngineHost, secret: str | None = None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    response = httpx.get(f"{host.address}/internal/load", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


# Registration.


def test_a_host_registers_while_it_runs_and_withdraws_when_it_stops(settings, start_host):
    host = start_host(settings)
    eventually(lambda: len(engine_records(settings.broker_url)) == 1)
    (registered,) = engine_records(settings.broker_url)
    assert registered.id == "worker-1" and registered.model == "tiny"
    assert registered.address == host.address and host.address.startswith("http://127.0.0.1:")
    assert (registered.running, registered.waiting, registered.admitted) == (0, 0, 0)
    assert registered.max_admitted == settings.max_realtime_queue
    first_beat = registered.beat
    eventually(
        lambda: engine_records(settings.broker_url)[0].beat > first_beat, timeout=3 * HEARTBEAT
    )

    host.stop()
    assert engine_records(settings.broker_url) == []  # withdrawn at once, not left to expire


def test_a_record_no_longer_renewed_expires_after_three_heartbeats(redis_url):
    async def publish_once() -> None:
        client = AsyncRedis.from_url(redis_url)
        try:
            await publish(client, record("gone"), HEARTBEAT)
        finally:
            await client.aclose()

    asyncio.run(publish_once())
    published = time.monotonic()
    assert [r.id for r in engine_records(redis_url)] == ["gone"]
    eventually(lambda: engine_records(redis_url) == [], timeout=10 * HEARTBEAT)
    assert time.monotonic() - published >= 3 * HEARTBEAT - 0.05


# Routing.


def test_routing_prefers_the_least_loaded_host_serving_the_model():
    busy = record("busy", running=6, waiting=2)
    light = record("light", running=3, kv_usage=0.5)
    lighter = record("lighter", running=3, kv_usage=0.1)
    other_model = record("other", model="big", running=0)
    hosts = [busy, light, lighter, other_model]
    assert [r.id for r in rank(hosts, "tiny")] == ["lighter", "light", "busy"]
    # Requests sent since their last heartbeat count too: the figures cannot show them yet.
    assert [r.id for r in rank(hosts, "tiny", Counter(lighter=4, light=1))] == [
        "light",
        "lighter",
        "busy",
    ]
    assert rank(hosts, "nope") == []


def test_a_request_for_a_lora_adapter_goes_to_the_hosts_that_serve_it():
    plain = record("plain", running=0)
    serving = record("serving", running=5, adapters=["sql"])
    assert [r.id for r in rank([plain, serving], "sql")] == ["serving"]
    assert [r.id for r in rank([plain, serving], "tiny")] == ["plain", "serving"]


def test_live_hosts_adapters_are_listed_with_their_parent(settings):
    adapted = record("adapted", model="big", address=DEAD, adapters=["sql"])
    asyncio.run(_publish(settings.broker_url, adapted))
    with serving(api_only(settings)) as url:
        sdk = client(url)
        assert {m.id: m.parent for m in sdk.models.list()} == {
            "tiny": None,
            "big": None,
            "sql": "big",
        }
        assert sdk.models.retrieve("sql").parent == "big"
        # Served by a host that cannot be reached: a 503 naming it, not a 404.
        with pytest.raises(openai.InternalServerError) as caught:
            sdk.completions.create(**completion(model="sql", max_tokens=2))
        assert "No engine serving model 'sql' can be reached" in caught.value.message


def test_the_api_streams_from_the_host_and_passes_over_one_that_is_gone(settings, start_host):
    host = start_host(settings)
    # A host that died a moment ago: its record has not expired yet, and it looks idle.
    asyncio.run(_publish(settings.broker_url, record("dead", address=DEAD)))
    eventually(lambda: len(engine_records(settings.broker_url)) == 2)
    with serving(api_only(settings)) as url:
        sdk = client(url)
        assert [m.id for m in sdk.models.list()] == ["tiny"]
        greedy = chat_body(max_tokens=8, temperature=0)
        chunks = list(
            sdk.chat.completions.create(**greedy, extra_body={"ignore_eos": True}, stream=True)
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        whole = sdk.chat.completions.create(**greedy, extra_body={"ignore_eos": True})
        assert whole.choices[0].message.content == "".join(
            c.choices[0].delta.content or "" for c in chunks
        )
        # The host's own checks answer through the API, unchanged.
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(**chat_body(max_tokens=10**6))
        assert caught.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.chat.completions.create(**chat_body(model="nope"))
        assert missing.value.body["code"] == "model_not_found"
    assert load(host)["running"] == 0


def test_a_forwarded_request_runs_the_pipeline_once_on_the_host(
    tmp_path, redis_url, tiny_llama, start_host
):
    """The API only checks and forwards: the content filter screens the prompt once, on the
    host, whose refusal the client gets through the API."""
    settings = Settings(
        data_dir=tmp_path / "data",
        broker_url=redis_url,
        model=str(tiny_llama),
        served_model_name="tiny",
        engine_heartbeat_seconds=HEARTBEAT,
        safety_policy="input",
        safety_blocklist=["forbidden"],
    )
    start_host(settings)
    eventually(lambda: len(engine_records(settings.broker_url)) == 1)
    refusals = CONTENT_FILTERED.labels("realtime", "input", BLOCKLIST)
    before = refusals._value.get()
    with serving(api_only(settings)) as url, pytest.raises(openai.BadRequestError) as caught:
        client(url).chat.completions.create(
            **chat_body(messages=[{"role": "user", "content": "Say forbidden."}])
        )
    assert caught.value.body["code"] == "content_filter"
    assert refusals._value.get() == before + 1


def test_a_transcription_form_reaches_the_host_whole(settings, start_host):
    """The API passes the form on with its content type, boundary and all: the host reads its
    fields and answers for the model (which takes no audio), through the API."""
    start_host(settings)
    eventually(lambda: len(engine_records(settings.broker_url)) == 1)
    with serving(api_only(settings)) as url, pytest.raises(openai.BadRequestError) as caught:
        client(url).audio.transcriptions.create(model="tiny", file=("clip.wav", b"RIFF...."))
    assert (caught.value.body["param"], caught.value.body["code"]) == (
        "model",
        "unsupported_content_type",
    )


def test_moderation_reaches_a_hosts_moderation_model(settings, start_host, make_checkpoint):
    guard = AsyncLLM(str(make_checkpoint("llama", task="classify")), num_kv_blocks=64)
    try:
        host = start_host(settings, guard=guard)
        eventually(lambda: len(engine_records(settings.broker_url)) == 1)
        texts = ["You are wonderful.", "I will find you."]
        with serving(api_only(settings)) as url:
            answer = client(url).moderations.create(input=texts, model="omni-moderation-latest")
        direct = client(host.address).moderations.create(input=texts)
        assert [r.category_scores for r in answer.results] == [
            r.category_scores for r in direct.results
        ]
    finally:
        guard.shutdown()


def test_the_models_are_the_configured_one_and_those_of_live_engines(settings):
    asyncio.run(_publish(settings.broker_url, record("gone", model="big", address=DEAD)))
    with serving(api_only(settings)) as url:
        sdk = client(url)
        assert [m.id for m in sdk.models.list()] == ["tiny", "big"]
        assert sdk.models.retrieve("big").id == "big"
        # Served, yet no engine can be reached: a 503, not a 404.
        for model in ("big", "tiny"):
            with pytest.raises(openai.InternalServerError) as caught:
                sdk.completions.create(**completion(model=model, max_tokens=2))
            assert caught.value.status_code == 503
            assert caught.value.body["code"] == "engine_unavailable"
            assert f"No engine serving model '{model}' can be reached" in caught.value.message


def test_engine_stats_are_the_live_hosts_heartbeats(settings, start_host):
    host = start_host(settings)
    httpx.post(f"{host.address}/v1/completions", json=completion(max_tokens=8), timeout=60)
    # Two beats after the work: the second has a rate over the first.
    eventually(lambda: engine_records(settings.broker_url)[0].tokens_per_second is not None)
    with serving(api_only(settings)) as url:
        response = httpx.get(f"{url}/v1/engine/stats")
    assert response.status_code == 200
    body = response.json()
    assert body["available"] is True
    (engine,) = body["engines"]
    assert engine["id"] == "worker-1" and engine["model"] == "tiny"
    assert (engine["running"], engine["waiting"]) == (0, 0)
    assert engine["tokens_per_second"] >= 0
    # The host's model, as it reported it at start.
    assert engine["resident"]["kv_cache_bytes"] > 0 and engine["resident"]["weights_bytes"] > 0


def test_a_full_host_answers_429_with_retry_after_through_the_api(settings, start_host):
    settings = replace_settings(settings, max_realtime_queue=1)
    host = start_host(settings)
    eventually(lambda: len(engine_records(settings.broker_url)) == 1)
    with serving(api_only(settings)) as url, httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=completion(stream=True, **LONG)) as held:
            events = held.iter_lines()  # kept: dropping it would hang up
            assert next(events).startswith("data: ")
            assert load(host)["admitted"] == 1
            with pytest.raises(openai.RateLimitError) as caught:
                client(url).completions.create(**completion(max_tokens=4))
            assert caught.value.response.headers["retry-after"] == "1"
            assert caught.value.body["code"] == "rate_limit_exceeded"
        # Leaving the stream closed the API's connection to the host, which aborted the request.
        eventually(lambda: load(host)["admitted"] == 0 and load(host)["running"] == 0)
        assert load(host)["kv_usage"] == 0.0
        assert client(url).completions.create(**completion(max_tokens=4)).choices


def test_a_client_leaving_a_whole_response_aborts_it_on_the_host(settings, start_host, engine):
    host = start_host(settings)
    eventually(lambda: len(engine_records(settings.broker_url)) == 1)
    generated = asyncio.run(engine.get_stats())["generation_tokens"]
    with serving(api_only(settings)) as url, httpx.Client(base_url=url) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=completion(**LONG), timeout=0.5)
        eventually(lambda: load(host)["running"] == 0 and load(host)["admitted"] == 0, 2.0)
    assert load(host)["kv_usage"] == 0.0
    # Ended early, not run to its end: it had seconds of work left.
    assert asyncio.run(engine.get_stats())["generation_tokens"] - generated < LONG["max_tokens"]


def test_with_a_secret_the_host_answers_only_the_api(settings, start_host):
    settings = replace_settings(settings, engine_secret=SECRET)
    host = start_host(settings)
    refused = httpx.post(f"{host.address}/v1/completions", json=completion(max_tokens=2))
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{host.address}/internal/load").status_code == 401
    assert load(host, SECRET)["model"] == "tiny"
    eventually(lambda: len(engine_records(settings.broker_url)) == 1)
    with serving(api_only(settings)) as url:
        assert client(url).completions.create(**completion(max_tokens=2)).choices


def test_a_web_page_cannot_reach_a_host_on_loopback(settings, start_host):
    # Without a secret (loopback only), a page the user visits could still reach the port: by
    # DNS rebinding (its own name as Host) or a cross-site form (an Origin, a text/plain body).
    host = start_host(settings)
    url = f"{host.address}/v1/completions"
    rebound = httpx.post(url, json=completion(max_tokens=2), headers={"host": "rebind.example"})
    assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"
    page = {"origin": "http://evil.example", "content-type": "text/plain"}
    cross_site = httpx.post(url, content=json.dumps(completion(max_tokens=2)), headers=page)
    assert cross_site.status_code == 403
    assert httpx.post(url, json=completion(max_tokens=2)).status_code == 200  # as the API calls


def test_a_host_beyond_loopback_needs_a_secret(settings, engine):
    settings = replace_settings(settings, engine_host="0.0.0.0")
    with pytest.raises(ValueError, match="PAGEDBATCH_ENGINE_SECRET"):
        EngineHost(worker_services(settings, engine), "worker-1")


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Once upon a time", "stream": False, **fields}


def replace_settings(settings: Settings, **changes: Any) -> Settings:
    return settings.model_copy(update=changes)


async def _publish(redis_url: str, engine_record: EngineRecord) -> None:
    client = AsyncRedis.from_url(redis_url)
    try:
        await publish(client, engine_record, heartbeat_seconds=10)
    finally:
        await client.aclose()

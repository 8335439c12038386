"""The distributed realtime door keeps tenants apart as the embedded one does: the API names each
request's tenant to the engine host, which shares its realtime capacity fairly among tenants and
salts its prefix cache by tenant."""

from __future__ import annotations

from contextlib import ExitStack

import httpx
import openai
from servers import engine_records, eventually
from test_engine_host import (  # noqa: F401 - fixtures
    LONG,
    completion,
    engine,
    load,
    replace_settings,
    serving,
    settings,
    start_host,
)

from pagedbatch.service import api_only

KEYS = ["k1", "k2"]
# Several full 16-token KV blocks, so that a repeat finds them cached.
PROMPT = "A question that this tenant asks twice, word for word. " * 6


def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def admitted(client: openai.OpenAI) -> bool:
    try:
        client.completions.create(**completion(max_tokens=2))
    except openai.RateLimitError:
        return False
    return True


def test_a_host_shares_its_capacity_and_its_prefix_cache_by_the_tenant_the_api_names(
    settings,  # noqa: F811 - the fixture imported above
    start_host,  # noqa: F811
):
    host = start_host(replace_settings(settings, max_realtime_queue=2))
    eventually(lambda: len(engine_records(settings.broker_url)) == 1)
    api = api_only(replace_settings(settings, api_keys=KEYS))
    with serving(api) as url, ExitStack() as held:
        first, second = sdk(url, KEYS[0]), sdk(url, KEYS[1])

        def cached(client: openai.OpenAI) -> int:
            answer = client.completions.create(**completion(prompt=PROMPT, max_tokens=2))
            return answer.usage.prompt_tokens_details.cached_tokens

        assert cached(first) == 0
        assert cached(first) > 0
        assert cached(second) == 0  # the first tenant's prefix is not the second's to find

        http = held.enter_context(
            httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEYS[0]}"}, timeout=60)
        )
        body = completion(stream=True, **LONG)
        streams = [held.enter_context(http.stream("POST", "/v1/completions", json=body))]
        streams.append(held.enter_context(http.stream("POST", "/v1/completions", json=body)))
        assert [response.status_code for response in streams] == [200, 200]
        assert not admitted(second)  # full: the second tenant now wants its share
        streams[0].close()
        eventually(lambda: load(host)["admitted"] == 1)
        assert not admitted(first)  # over its share of one
        assert admitted(second)

"""The admin API's usage, through the `openai` SDK's `admin.organization.usage.completions`: after
realtime requests and batches of two tenants, every bucket's sums equal the responses' and the
batches' `usage`, exactly, however grouped; a tenant reads only itself; buckets and pages are
where they say."""

from __future__ import annotations

import time
from collections import Counter

import openai
import pytest
from servers import eventually
from test_batches import chat_line, create, finished

from pagedbatch.api.auth import key_owner

TENANTS = ("alice", "bob")
ADMIN = "root"


def admin(server) -> openai.OpenAI:
    url = f"{server.url}/v1"
    return openai.OpenAI(base_url=url, api_key="unused", admin_api_key=ADMIN, max_retries=0)


def tenant_reader(server, key: str) -> openai.OpenAI:
    # A tenant reads its own usage with its own key, sent the way the SDK sends admin keys.
    url = f"{server.url}/v1"
    return openai.OpenAI(base_url=url, api_key="unused", admin_api_key=key, max_retries=0)


def work(server) -> tuple[Counter, int]:
    """Realtime requests and a batch per tenant; the tokens their responses report, by (tenant,
    batch or not), and when it began."""
    began = int(time.time())
    used: Counter = Counter()
    for i, key in enumerate(TENANTS):
        client = server.client(key)
        for n in range(2 + i):
            answer = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"Hello {key} {n}"}],
                max_tokens=4 + n,
            )
            used[(key, False, "input")] += answer.usage.prompt_tokens
            used[(key, False, "cached")] += answer.usage.prompt_tokens_details.cached_tokens
            used[(key, False, "output")] += answer.usage.completion_tokens
            used[(key, False, "requests")] += 1
        stream = client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage][0]
        used[(key, False, "input")] += usage.prompt_tokens
        used[(key, False, "cached")] += usage.prompt_tokens_details.cached_tokens
        used[(key, False, "output")] += usage.completion_tokens
        used[(key, False, "requests")] += 1
        lines = [chat_line(f"{key}-{j}", content=f"Line {j}", max_tokens=3 + j) for j in range(3)]
        batch = finished(client, create(client, lines).id)
        assert batch.status == "completed"
        used[(key, True, "input")] += batch.usage.input_tokens
        used[(key, True, "cached")] += batch.usage.input_tokens_details.cached_tokens
        used[(key, True, "output")] += batch.usage.output_tokens
        used[(key, True, "requests")] += batch.request_counts.completed
    return used, began


def sums(page, fields=("api_key_id", "batch")) -> Counter:
    found: Counter = Counter()
    for bucket in page.data:
        for result in bucket.results:
            group = tuple(getattr(result, f) for f in fields)
            found[(*group, "input")] += result.input_tokens
            found[(*group, "cached")] += result.input_cached_tokens
            found[(*group, "output")] += result.output_tokens
            found[(*group, "requests")] += result.num_model_requests
    return +found  # without the zeros


@pytest.fixture
def server(serve_batches):
    return serve_batches(api_keys=",".join(TENANTS), admin_keys=ADMIN)


def test_usage_sums_equal_what_the_responses_reported(server):
    used, began = work(server)
    expected = +Counter({(key_owner(k), b, what): n for (k, b, what), n in used.items()})
    usage = admin(server).admin.organization.usage

    def read(**options):
        return usage.completions(start_time=began, bucket_width="1d", **options)

    # Realtime records reach the ledger within a flush (a second).
    eventually(lambda: sums(read(group_by=["api_key_id", "batch"])) == expected, timeout=10)
    by_model = read(group_by=["model"])
    assert {r.model for b in by_model.data for r in b.results} == {"tiny"}
    total = sum(r.input_tokens for b in by_model.data for r in b.results)
    assert total == sum(n for (_, _, what), n in used.items() if what == "input")
    # Filters: batch lines only, one tenant's key.
    batch_only = read(batch=True, group_by=["api_key_id", "batch"])
    assert sums(batch_only) == Counter({k: n for k, n in expected.items() if k[1]})
    alice = key_owner("alice")
    one = read(api_key_ids=[alice], group_by=["api_key_id", "batch"])
    assert sums(one) == Counter({k: n for k, n in expected.items() if k[0] == alice})


def test_a_tenant_reads_only_itself_and_others_are_refused(server):
    used, began = work(server)
    bob = key_owner("bob")
    mine = +Counter({(bob, b, what): n for (k, b, what), n in used.items() if k == "bob"})
    reader = tenant_reader(server, "bob").admin.organization.usage

    def read(**options):
        return reader.completions(start_time=began, group_by=["api_key_id", "batch"], **options)

    eventually(lambda: sums(read()) == mine, timeout=10)
    # Asking for another tenant's key finds nothing, rather than its usage.
    assert sums(read(api_key_ids=[key_owner("alice")])) == Counter()
    with pytest.raises(openai.AuthenticationError):
        tenant_reader(server, "nobody").admin.organization.usage.completions(start_time=began)


def test_buckets_are_aligned_and_pages_follow_each_other(server):
    used, began = work(server)
    usage = admin(server).admin.organization.usage
    start = began - 150  # mid-minute, two and a half minutes before the work
    minute = start - start % 60
    total = sum(n for (_, _, what), n in used.items() if what == "requests")

    def pages():
        page = usage.completions(start_time=start, bucket_width="1m", limit=2)
        yield page
        while page.has_more:
            page = usage.completions(
                start_time=start, bucket_width="1m", limit=2, page=page.next_page
            )
            yield page

    def read() -> list:
        return [bucket for page in pages() for bucket in page.data]

    eventually(
        lambda: sum(r.num_model_requests for b in read() for r in b.results) == total, timeout=10
    )
    buckets = read()
    assert buckets[0].start_time == start and buckets[0].end_time == minute + 60
    for before, after in zip(buckets, buckets[1:], strict=False):
        assert after.start_time == before.end_time and after.start_time % 60 == 0
    assert all(not b.results for b in buckets[:2])  # before the work began
    with pytest.raises(openai.BadRequestError):
        usage.completions(start_time=start, bucket_width="1m", limit=2000)
    with pytest.raises(openai.BadRequestError):
        usage.completions(start_time=start, group_by=["project_id"])


PRICES = {"tiny": {"input": 2.0, "cached_input": 1.0, "output": 8.0}}


def test_costs_at_the_prices_with_batch_tokens_discounted(serve_batches):
    server = serve_batches(
        api_keys=",".join(TENANTS),
        admin_keys=ADMIN,
        prices=PRICES,
        batch_discount=0.5,
        metrics_token="m",
        metrics_cache_seconds=0,
    )
    used, began = work(server)
    costs = admin(server).admin.organization.usage.costs
    expected = {}
    for batch, suffix, factor in ((False, "", 1.0), (True, " (batch)", 0.5)):
        tokens: Counter = Counter()
        for (_, was_batch, what), n in used.items():
            if was_batch == batch:
                tokens[what] += n
        for kind, count, price in (
            ("input", tokens["input"] - tokens["cached"], 2.0),
            ("cached input", tokens["cached"], 1.0),
            ("output", tokens["output"], 8.0),
        ):
            if count:
                expected[f"tiny, {kind}{suffix}"] = (count, count * price * factor / 1e6)

    def items() -> dict:
        page = costs(start_time=began, group_by=["line_item"])
        return {r.line_item: (r.quantity, r.amount.value) for b in page.data for r in b.results}

    quantities = {name: quantity for name, (quantity, _) in expected.items()}
    eventually(lambda: {k: q for k, (q, _) in items().items()} == quantities, timeout=10)
    for name, (quantity, usd) in items().items():
        assert usd == pytest.approx(expected[name][1], rel=1e-9)
        assert quantity == expected[name][0]
    [total] = [r for b in costs(start_time=began).data for r in b.results]
    assert total.amount.currency == "usd" and total.line_item is None
    assert total.amount.value == pytest.approx(sum(usd for _, usd in expected.values()))
    # /metrics says the same, by mode.
    metrics = server.http("m").get("/metrics").text
    batch_usd = sum(usd for name, (_, usd) in expected.items() if name.endswith("(batch)"))
    [line] = [
        x
        for x in metrics.splitlines()
        if x.startswith("pagedbatch:cost_usd_total{") and 'mode="batch"' in x
    ]
    assert float(line.split()[-1]) == pytest.approx(batch_usd)


def test_a_model_without_a_price_costs_nothing_and_says_so(server):
    _, began = work(server)
    costs = admin(server).admin.organization.usage.costs

    def items():
        page = costs(start_time=began, group_by=["line_item"])
        return [r for b in page.data for r in b.results]

    eventually(lambda: any(r.line_item == "tiny, output (batch)" for r in items()), timeout=10)
    assert all(r.amount.value == 0 and r.quantity > 0 for r in items())

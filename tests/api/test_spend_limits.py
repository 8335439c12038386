"""Spend limits, through the `openai` SDK: the service's (`admin.organization.spend_limit`) and
each key's monthly one. Every realtime request and batch line reserves its worst case before any
engine work, so however many run at once, spend (as the usage ledger counts it) never passes a
limit: what a budget cannot cover is refused with 429 `insufficient_quota`, a batch line with an
error line of it while its batch completes. The same through the distributed API, where the
worker's engine host reserves."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from servers import STORAGES, engine_records, eventually
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from test_batches import chat_line, create, finished, results
from test_engine_host import serving
from test_usage import ADMIN, TENANTS, admin

from pagedbatch.api.deps import Services
from pagedbatch.api.engine_host import EngineHost
from pagedbatch.costs import NANOS_PER_USD
from pagedbatch.engine import AsyncLLM
from pagedbatch.ids import now
from pagedbatch.service import api_only, open_store
from pagedbatch.settings import Settings
from pagedbatch.store.models import SpendBudget, SpendReservation
from pagedbatch.store.reservations import month_start
from pagedbatch.store.usage import ALL_TIME, LedgerWriter, UsageQuery, usage_sums

# A cent a token, in and out. A chat of "Hi" is 12 prompt tokens; with max_tokens 10 (and
# ignore_eos, so it uses them all) it costs 0.22 USD at worst and at best.
PRICES = {"tiny": {"input": 10_000.0, "output": 10_000.0}}
CHAT_USD = 0.22


def chat(client: openai.OpenAI, **fields):
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=10,
        extra_body={"ignore_eos": True},
        **fields,
    )


def refused(call: Callable[[], object]) -> bool:
    """Whether `call` was refused for want of budget (a 429 insufficient_quota); any other
    failure is raised."""
    try:
        call()
    except openai.RateLimitError as e:
        assert (e.body["type"], e.body["code"]) == ("insufficient_quota", "insufficient_quota")
        return True
    return False


def at_once(calls: int, call: Callable[[], object]) -> list[bool]:
    """`calls` of `call` at once, from as many threads: which were refused."""
    with ThreadPoolExecutor(calls) as pool:
        return list(pool.map(lambda _: refused(call), range(calls)))


def ledger(sessions: sessionmaker[Session], prices: Settings) -> tuple[int, float]:
    """The usage ledger's requests this month, and what they cost at the prices."""
    query = UsageQuery(
        start=month_start(now()),
        end=now() + 1,
        width=ALL_TIME,
        group_by=frozenset({"model", "batch"}),
    )
    with sessions() as session:
        sums = usage_sums(session, query)
    usd = sum(item.usd for s in sums for item in s.line_items(prices.prices, prices.batch_discount))
    return sum(s.requests for s in sums), usd


def held(sessions: sessionmaker[Session]) -> int:
    """What running requests hold reserved in the service's budget, in nano-dollars."""
    with sessions() as session:
        return sum(session.scalars(select(SpendReservation.nanos)).all())


def nothing_held(sessions: sessionmaker[Session]) -> bool:
    with sessions() as session:
        reserved = session.scalars(select(SpendBudget.reserved_nanos)).all()
        return not session.scalars(select(SpendReservation.id)).all() and not any(reserved)


def serve(serve_batches, **settings):
    return serve_batches(api_keys=",".join(TENANTS), admin_keys=ADMIN, prices=PRICES, **settings)


@pytest.mark.parametrize("storage", STORAGES, indirect=True)
def test_twenty_concurrent_chats_of_one_key_never_spend_past_its_limit(serve_batches):
    """A dollar holds four chats' worst case (0.88 USD), not five: four are answered, sixteen
    refused, however the twenty race."""
    server = serve(serve_batches, key_monthly_spend_limit_usd=1)
    sessions = server.embedded.services.session_factory
    outcomes = at_once(20, lambda: chat(server.client("alice")))
    assert outcomes.count(False) == 4
    eventually(lambda: ledger(sessions, server.settings)[0] == 4, timeout=10)
    assert ledger(sessions, server.settings)[1] == pytest.approx(4 * CHAT_USD)
    eventually(lambda: nothing_held(sessions), timeout=10)  # each settled when it ended


@pytest.mark.parametrize("storage", STORAGES, indirect=True)
def test_a_batch_past_the_budget_fails_its_remaining_lines_with_insufficient_quota(
    serve_batches,
):
    """0.66 USD spent of a dollar: of twenty lines at 0.11 USD (the batch discount halves a
    chat's 0.22), three fit; the other seventeen fail with insufficient_quota error lines, and
    the batch completes."""
    server = serve(serve_batches, key_monthly_spend_limit_usd=1)
    sessions = server.embedded.services.session_factory
    alice = server.client("alice")
    for _ in range(3):
        chat(alice)
    lines = [chat_line(f"l{i}", content="Hi", max_tokens=10, ignore_eos=True) for i in range(20)]
    batch = finished(alice, create(alice, lines).id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 17)
    output, errors = results(alice, batch)
    assert len(output) == 3 and len(errors) == 17
    for line in errors:
        assert line["response"]["status_code"] == 429
        error = line["response"]["body"]["error"]
        assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    eventually(lambda: ledger(sessions, server.settings)[0] == 6, timeout=10)
    assert ledger(sessions, server.settings)[1] == pytest.approx(3 * CHAT_USD + 3 * CHAT_USD / 2)
    assert ledger(sessions, server.settings)[1] <= 1
    assert nothing_held(sessions)


def test_requests_that_end_early_settle_to_what_they_used(serve_batches):
    """A stream whose client leaves after its first piece, and a whole response whose client
    gives up waiting: each held its worst case (15 USD: 1,500 tokens) while it ran, and settles
    to what the ledger records of it (the stream's first tokens; nothing of the other)."""
    server = serve(serve_batches, key_monthly_spend_limit_usd=100)
    sessions = server.embedded.services.session_factory
    long = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1500}
    long["ignore_eos"] = True
    with server.http("alice") as http:
        with http.stream("POST", "/v1/chat/completions", json={**long, "stream": True}) as events:
            assert next(events.iter_lines()).startswith("data: ")
            assert held(sessions) >= 15 * NANOS_PER_USD
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=long, timeout=0.5)
    eventually(lambda: nothing_held(sessions), timeout=10)
    requests, usd = ledger(sessions, server.settings)
    assert requests == 1 and 0 < usd < 15
    with sessions() as session:
        spent = session.scalars(select(SpendBudget.spent_nanos)).all()
    assert spent == [pytest.approx(usd * NANOS_PER_USD, abs=2)] * 2  # the key's, the service's


def test_past_the_service_limit_requests_and_new_batches_are_refused(serve_batches):
    """The service's limit binds every key; set below what was spent, it is enforcing, and new
    batches are refused too. Nothing refused reaches the engine."""
    server = serve(serve_batches)
    limits = admin(server).admin.organization.spend_limit
    alice, bob = server.client("alice"), server.client("bob")
    with pytest.raises(openai.NotFoundError):
        limits.retrieve()
    limit = limits.update(currency="USD", interval="month", threshold_amount=100)  # a dollar
    assert (limit.threshold_amount, limit.enforcement.status) == (100, "inactive")
    # Four chats, 0.88 USD, whoever sends them: a fifth could take the service to 1.10.
    outcomes = [refused(lambda client=client: chat(client)) for client in (alice, bob) * 3]
    assert outcomes == [False] * 4 + [True] * 2
    engine = server.embedded.context.engine.engine
    tokens_run = engine.get_stats()["batched_tokens"]
    assert refused(lambda: chat(alice)) and refused(lambda: chat(bob))
    assert engine.get_stats()["batched_tokens"] == tokens_run
    lowered = limits.update(currency="USD", interval="month", threshold_amount=50)
    assert lowered.enforcement.status == "enforcing"
    assert refused(lambda: create(bob, [chat_line("x")]))
    assert limits.delete().deleted
    assert chat(bob).choices


def test_a_key_past_its_monthly_limit_is_refused_alone(serve_batches):
    server = serve(serve_batches, key_monthly_spend_limit_usd=0.5)
    alice, bob = server.client("alice"), server.client("bob")
    chat(alice)
    chat(alice)
    assert refused(lambda: chat(alice))  # 0.44 spent: another 0.22 would pass 0.50
    assert chat(bob).choices
    assert create(bob, [chat_line("y")]).status == "validating"


def test_only_admin_keys_touch_the_spend_limit(serve_batches):
    server = serve(serve_batches)
    as_tenant = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", admin_api_key="alice", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        as_tenant.admin.organization.spend_limit.update(
            currency="USD", interval="month", threshold_amount=1
        )


# The distributed API: it forwards realtime requests to a worker's engine host, which tokenizes
# them, and so reserves their spend; the API reserves nothing.


@pytest.fixture
def engine(tiny_llama: Path) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(str(tiny_llama), served_model_name="tiny", num_kv_blocks=128)
    yield llm
    llm.shutdown()


def test_through_the_distributed_api_the_engine_host_reserves_once(
    tmp_path, redis_url, engine, tiny_llama
):
    settings = Settings(
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
        broker_url=redis_url,
        model=str(tiny_llama),
        served_model_name="tiny",
        engine_heartbeat_seconds=0.2,
        api_keys=list(TENANTS),
        prices=PRICES,
        key_monthly_spend_limit_usd=1,
    )
    sessions, blobs = open_store(settings)
    ledger_writer = LedgerWriter(sessions)
    services = Services(settings, sessions, blobs, engine=engine, ledger=ledger_writer)
    host = EngineHost(services, "worker-1")
    host.start()
    try:
        eventually(lambda: len(engine_records(redis_url)) == 1)
        with serving(api_only(settings)) as url:
            alice = openai.OpenAI(base_url=f"{url}/v1", api_key="alice", max_retries=0)
            outcomes = at_once(20, lambda: chat(alice))
        # Reserved twice (by the API and the host), only two would have been answered.
        assert outcomes.count(False) == 4
        eventually(lambda: ledger(sessions, settings)[0] == 4, timeout=10)
        assert ledger(sessions, settings)[1] == pytest.approx(4 * CHAT_USD)
        eventually(lambda: nothing_held(sessions), timeout=10)
    finally:
        host.stop()

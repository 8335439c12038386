"""Realtime admission: counted in sequences (prompts × n), shared fairly among tenants, given
back when the engine is done rather than when the client has read, and slow readers dropped;
each tenant's prefix cache its own."""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack, closing
from urllib.parse import urlsplit

import openai
import pytest
from servers import API_KEYS, BatchServer
from test_realtime import (
    LONG,
    chat_body,
    completion_body,
    idle,
    seconds_until,
    seconds_until_idle,
    stats,
)

from pagedbatch.api.realtime import DEMAND_GRACE_SECONDS, Admission, Refusal, Ticket

# The rules, on a clock of our own.


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def admitted(outcome: Ticket | Refusal) -> Ticket:
    assert isinstance(outcome, Ticket), outcome
    return outcome


def refused(outcome: Ticket | Refusal) -> Refusal:
    assert isinstance(outcome, Refusal), outcome
    return outcome


def test_sequences_count_against_the_limit():
    admission = Admission(8)
    first = admitted(admission.enter("a", 6))
    assert admission.admitted == 6
    refused(admission.enter("a", 3))  # 9 > 8
    admitted(admission.enter("a", 2))
    first.release()
    first.release()  # once only
    assert admission.admitted == 2


def test_the_room_freed_goes_to_a_tenant_holding_nothing_however_often_another_asks():
    """The issue's flood: a tenant loops the largest request the door takes (all of the
    default limit); the other, refused once, finds the room kept for it when it retries."""
    clock = Clock()
    admission = Admission(256, clock=clock)
    running = admitted(admission.enter("a", 256))
    refused(admission.enter("b", 1))
    for _ in range(3):
        refused(admission.enter("a", 256))  # a's other clients, asking all the while
    running.release()
    for _ in range(3):  # b's retry has not come yet: a, holding nothing too, is placed after b
        refused(admission.enter("a", 256))
    clock.now += 1.0
    turn = admitted(admission.enter("b", 1))
    refused(admission.enter("a", 256))  # 256 + b's 1 > 256
    turn.release()
    admitted(admission.enter("a", 256))


def test_a_tenant_holding_nothing_goes_before_one_holding_some():
    clock = Clock()
    admission = Admission(4, clock=clock)
    held = [admitted(admission.enter("a", 1)) for _ in range(4)]  # alone: a may take everything
    refused(admission.enter("b", 2))
    clock.now += 0.1
    held[0].release()
    refused(admission.enter("a", 1))  # the freed one is kept for b, who needs two
    refused(admission.enter("c", 1))  # c asked after b
    held[1].release()
    admitted(admission.enter("b", 2))


def test_refused_tenants_get_in_in_the_order_they_asked():
    clock = Clock()
    admission = Admission(4, clock=clock)
    running = admitted(admission.enter("a", 4))
    refused(admission.enter("b", 3))
    clock.now += 0.1
    refused(admission.enter("c", 3))
    running.release()
    refused(admission.enter("c", 3))  # 3 + b's 3 > 4
    b = admitted(admission.enter("b", 3))
    refused(admission.enter("c", 3))
    b.release()
    admitted(admission.enter("c", 3))


def test_the_room_kept_lapses_if_its_tenant_does_not_come_back():
    clock = Clock()
    admission = Admission(4, clock=clock)
    running = admitted(admission.enter("a", 4))
    refusal = refused(admission.enter("b", 1))
    running.release()
    refused(admission.enter("a", 4))
    clock.now += refusal.retry_after + DEMAND_GRACE_SECONDS
    admitted(admission.enter("a", 4))  # b gave up: the engine does not idle for it for ever


def test_retry_after_is_when_the_room_asked_for_is_expected():
    clock = Clock()
    fresh = Admission(8, clock=clock)
    admitted(fresh.enter("a", 8))
    assert refused(fresh.enter("b", 1)).retry_after == 1  # nothing finished: nothing to go by
    admission = Admission(8, clock=clock)
    first = admitted(admission.enter("a", 8))
    clock.now += 10.0
    first.release()
    assert admission.run_seconds == 10.0  # requests run 10 s
    admitted(admission.enter("a", 4))
    clock.now += 3.0
    admitted(admission.enter("a", 4))
    assert refused(admission.enter("b", 2)).retry_after == 7  # when a's first ends
    # At its own limit, a tenant waits for its own requests.
    capped = Admission(8, tenant_share=0.5, clock=clock)
    capped.run_seconds = 10.0
    admitted(capped.enter("a", 4))
    assert refused(capped.enter("a", 1)).retry_after == 10
    # Placed after a claim larger than what runs: once that claimant has had its turn.
    behind = Admission(4, clock=clock)
    behind.run_seconds = 10.0
    admitted(behind.enter("a", 2))
    assert refused(behind.enter("b", 4)).retry_after == 10
    clock.now += 0.5
    assert refused(behind.enter("c", 2)).retry_after == 20


def test_a_tenant_at_its_own_limit_keeps_no_room_from_others():
    admission = Admission(4, tenant_share=0.5)
    assert admission.max_request == 2
    admitted(admission.enter("a", 2))
    refused(admission.enter("a", 1))  # a's share is 2 of the 4
    admitted(admission.enter("b", 2))  # b gets in at once: a's refusal claimed nothing


# The realtime door.


def test_a_request_is_admitted_by_its_sequences(serve_batches):
    server: BatchServer = serve_batches(max_realtime_queue=4)
    client = server.client()
    with server.http() as http:
        # 3 prompts × n=2 is 6 sequences: more than the engine ever takes at once.
        too_big = http.post("/v1/completions", json=completion_body(prompt=["a", "b", "c"], n=2))
        assert too_big.status_code == 400
        assert too_big.json()["error"]["param"] == "prompt"
        assert too_big.json()["error"]["code"] == "too_many_sequences"
        with http.stream("POST", "/v1/completions", json=completion_body(n=3, stream=True, **LONG)):
            seconds_until(lambda: stats(server)["running"] == 3)
            with pytest.raises(openai.RateLimitError):  # 3 + 2 > 4
                client.completions.create(**completion_body(n=2))
            assert client.completions.create(**completion_body(n=1)).choices
    seconds_until_idle(server)


def test_one_tenant_cannot_keep_another_out(serve_batches):
    server: BatchServer = serve_batches(max_realtime_queue=4, api_keys=API_KEYS)
    first, second = server.client(API_KEYS[0]), server.client(API_KEYS[1])
    with server.http(API_KEYS[0]) as http, ExitStack() as held:
        body = completion_body(stream=True, **LONG)
        streams = [
            held.enter_context(http.stream("POST", "/v1/completions", json=body)) for _ in range(4)
        ]
        assert [response.status_code for response in streams] == [200] * 4
        with pytest.raises(openai.RateLimitError):
            second.completions.create(**completion_body())
        streams[0].close()

        def admitted(client: openai.OpenAI) -> bool:
            try:
                client.completions.create(**completion_body(max_tokens=2))
            except openai.RateLimitError:
                return False
            return True

        # The first tenant, over its share now that the second wants one, is refused the room
        # it freed; the second gets it.
        seconds_until(lambda: stats(server)["running"] == 3)
        assert not admitted(first)
        assert admitted(second)
    seconds_until_idle(server)


def unread_stream(server: BatchServer, path: str, body: dict) -> socket.socket:
    """A streamed request from a client that reads nothing of the answer (a tiny receive
    buffer, so the server soon cannot send more)."""
    address = urlsplit(server.url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((address.hostname, address.port))
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """What the server sent, once it has closed the connection."""
    sock.settimeout(10)
    received = bytearray()
    while chunk := sock.recv(1 << 16):
        received += chunk
    return bytes(received)


SEND_BUFFER = 4096  # the server's kernel buffer towards each client, which the kernel doubles
# Each event carries five logprobs: some 100 KB a client must read for the whole stream, more
# than the buffers between the server and a client that reads nothing (the kernel's both ends,
# and the server's 64 KiB before it stops writing).
BULKY = completion_body(max_tokens=200, ignore_eos=True, logprobs=5, stream=True)


def test_sequences_are_given_back_when_the_engine_is_done_not_when_the_client_read(
    serve_batches,
):
    server: BatchServer = serve_batches(
        max_realtime_queue=2, stream_send_timeout_seconds=60, send_buffer_bytes=SEND_BUFFER
    )
    client = server.client()
    with ExitStack() as stack:
        for _ in range(2):
            stack.enter_context(closing(unread_stream(server, "/v1/completions", BULKY)))
        seconds_until(lambda: stats(server)["running"] == 2)
        seconds_until(lambda: idle(stats(server)), timeout=60)
        # Neither client has read its stream, and both sockets are open.
        assert client.completions.create(**completion_body(max_tokens=2)).choices


def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted(serve_batches):
    server: BatchServer = serve_batches(
        stream_send_timeout_seconds=1, send_buffer_bytes=SEND_BUFFER
    )
    body = {**BULKY, "max_tokens": 1500}
    with closing(unread_stream(server, "/v1/completions", body)) as sock:
        seconds_until(lambda: stats(server)["running"] == 1)
        started = time.monotonic()
        seconds_until(lambda: idle(stats(server)), timeout=30)
        assert time.monotonic() - started < 15  # 1500 tokens would take longer on two cores
        sent = read_all(sock)  # the server closed the connection
    assert b"HTTP/1.1 200" in sent
    assert b"data: [DONE]" not in sent


def test_each_tenant_finds_only_its_own_prompts_in_the_prefix_cache(serve_batches):
    server: BatchServer = serve_batches(api_keys=API_KEYS)
    assert cached_tokens(server, API_KEYS[0]) == 0
    assert cached_tokens(server, API_KEYS[0]) > 0  # its own prefix, cached by its first request
    assert cached_tokens(server, API_KEYS[1]) == 0  # not another tenant's


def test_tenants_may_share_the_prefix_cache(serve_batches):
    server: BatchServer = serve_batches(api_keys=API_KEYS, share_prefix_cache_across_tenants=True)
    assert cached_tokens(server, API_KEYS[0]) == 0
    assert cached_tokens(server, API_KEYS[1]) > 0


# A prompt of several full KV blocks (16 tokens each), so that a repeat finds them cached.
SHARED_PROMPT = [{"role": "user", "content": "The same long question, asked again. " * 12}]


def cached_tokens(server: BatchServer, key: str) -> int:
    answer = server.client(key).chat.completions.create(**chat_body(messages=SHARED_PROMPT))
    return answer.usage.prompt_tokens_details.cached_tokens

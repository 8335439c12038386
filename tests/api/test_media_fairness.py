"""Image URLs from slow hosts: all of a request's fetches share one deadline, and one tenant's
slow fetches hold up neither another tenant's plain chat nor its own fetches."""

from __future__ import annotations

import http.server
import io
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from servers import API_KEYS, BatchServer
from test_images import image_part, picture

from pagedbatch.api.preparation import FETCH_THREADS_PER_TENANT

PIECES = 10


@dataclass
class TrickleHost:
    """A host of one PNG that `/<seconds>/<tenant>-<n>.png` sends in pieces over that many
    seconds; it counts the fetches under way by the tenant the name gives."""

    url: str
    png: bytes
    started: list[str] = field(default_factory=list)  # names, in the order asked for
    fetching: Counter[str] = field(default_factory=Counter)
    most: Counter[str] = field(default_factory=Counter)  # the most at once
    lock: threading.Lock = field(default_factory=threading.Lock)

    def image(self, seconds: float, name: str) -> dict:
        return image_part(f"{self.url}/{seconds:g}/{name}.png")


class _Trickle(http.server.BaseHTTPRequestHandler):
    host: TrickleHost

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        host = self.server.host  # type: ignore[attr-defined]
        _, seconds, name = self.path.split("/")
        tenant = name.partition("-")[0]
        with host.lock:
            host.started.append(name.removesuffix(".png"))
            host.fetching[tenant] += 1
            host.most[tenant] = max(host.most[tenant], host.fetching[tenant])
        try:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(host.png)))
            self.end_headers()
            step = -(-len(host.png) // PIECES)
            for start in range(0, len(host.png), step):
                time.sleep(float(seconds) / PIECES)
                self.wfile.write(host.png[start : start + step])
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the fetcher gave up: its deadline passed
        finally:
            with host.lock:
                host.fetching[tenant] -= 1

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def trickle_host() -> Iterator[TrickleHost]:
    buffer = io.BytesIO()
    picture(7).save(buffer, format="PNG")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    server.daemon_threads = True
    server.host = TrickleHost(f"http://127.0.0.1:{server.server_address[1]}", buffer.getvalue())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.host
    server.shutdown()


@pytest.fixture(scope="module")
def tiny_llava(make_checkpoint) -> Path:
    return make_checkpoint("llava")


def ask(client: openai.OpenAI, *parts: dict):
    content = [*parts, {"type": "text", "text": "What is in this picture?"}]
    return client.chat.completions.create(
        model="llava", messages=[{"role": "user", "content": content}], max_tokens=2
    )


def test_all_of_a_requests_fetches_share_one_deadline(serve_batches, tiny_llava, trickle_host):
    server: BatchServer = serve_batches(
        model=str(tiny_llava),
        served_model_name="llava",
        media_allowed_hosts="127.0.0.1",
        media_fetch_deadline_seconds=3,
        max_images_per_request=3,
    )
    client = server.client()
    assert ask(client, trickle_host.image(2, "a-0")).choices  # one alone arrives in time
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, *(trickle_host.image(2, f"a-{n}") for n in (1, 2, 3)))
    took = time.monotonic() - started
    error = caught.value.body
    assert "3 s (media_fetch_deadline_seconds)" in error["message"]
    assert error["param"] == "messages[0].content[1].image_url"  # under way at 3 s
    assert error["code"] == "invalid_image_url"
    assert trickle_host.started == ["a-0", "a-1", "a-2"]  # the third was never asked for
    # The deadline cuts off a body that trickles in, rather than after a piece comes.
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError, match="media_fetch_deadline_seconds"):
        ask(client, trickle_host.image(60, "a-4"))
    assert max(took, time.monotonic() - started) < 3 + 2


def test_one_tenants_slow_images_do_not_hold_up_another_tenant(
    serve_batches, tiny_llava, trickle_host
):
    server: BatchServer = serve_batches(
        api_keys=API_KEYS,
        model=str(tiny_llava),
        served_model_name="llava",
        media_allowed_hosts="127.0.0.1",  # and the default deadline of 10 s
    )
    first, second = server.client(API_KEYS[0]), server.client(API_KEYS[1])
    started = time.monotonic()
    assert ask(second).choices  # the engine warmed up, and the time a plain chat takes
    alone = time.monotonic() - started
    answers: list[str] = []

    def slow(n: int) -> None:
        answer = ask(first, trickle_host.image(6, f"a-{n}"))
        answers.append(answer.choices[0].finish_reason)

    flood = [threading.Thread(target=slow, args=(n,)) for n in range(4)]
    for thread in flood:
        thread.start()
    deadline = time.monotonic() + 10
    while trickle_host.fetching["a"] < FETCH_THREADS_PER_TENANT:
        assert time.monotonic() < deadline, "A's fetches did not start"
        time.sleep(0.01)
    # A plain chat of the other tenant: nothing of its own to fetch, so nothing to wait for.
    started = time.monotonic()
    assert ask(second).choices
    plain = time.monotonic() - started
    # Its own slow image is asked for at once, while two of A's four wait their turn.
    asked = time.monotonic()
    fetching = threading.Thread(target=ask, args=(second, trickle_host.image(1, "b-0")))
    fetching.start()
    while "b-0" not in trickle_host.started:
        assert time.monotonic() - asked < 10, "B's fetch did not start"
        time.sleep(0.01)
    waited = time.monotonic() - asked
    a_started = sum(name.startswith("a-") for name in trickle_host.started)
    fetching.join(60)
    for thread in flood:
        thread.join(60)
    print(f"B's plain chat {plain:.2f} s ({alone:.2f} s alone); its fetch began in {waited:.2f} s")
    assert plain < alone + 1.0
    assert waited < 1.0 and a_started == FETCH_THREADS_PER_TENANT
    assert len(answers) == 4  # A's requests were delayed, not refused
    assert trickle_host.most["a"] == FETCH_THREADS_PER_TENANT

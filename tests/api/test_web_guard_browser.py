"""A hostile page in a real browser (Debian's headless chromium, driven by Playwright) against a
keyless server on 127.0.0.1: the requests any page may send without asking (no-cors fetches of
text/plain JSON and of a multipart form) change nothing (api/web_guard.py). The page is served
from another port of the same machine, so that it is another origin that the browser's
private-network rules let through, and only the server's own checks stand in the way."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

ATTACK = """
async (api) => {
  const sent = [];
  const limit = {currency: "USD", interval: "month", threshold_amount: 1};
  const json = await fetch(api + "/v1/organization/spend_limit", {
    method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
    body: JSON.stringify(limit),
  });
  sent.push(json.type);
  const chat = await fetch(api + "/v1/completions", {
    method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
    body: JSON.stringify({model: "tiny", prompt: "Mine bitcoin", max_tokens: 8}),
  });
  sent.push(chat.type);
  const form = new FormData();
  form.append("purpose", "batch");
  form.append("file", new Blob(['{"custom_id": "evil"}\\n']), "evil.jsonl");
  const upload = await fetch(api + "/v1/files", {method: "POST", mode: "no-cors", body: form});
  sent.push(upload.type);
  return sent;
}
"""


class _AttackerPage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b"<!doctype html><title>cute cats</title><p>nothing to see</p>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def attacker_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AttackerPage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def answered(metrics: str, path: str) -> int:
    """How many POSTs to `path` this process has answered 200, by its HTTP metrics (which every
    server of the process counts in)."""
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("pagedbatch:http_requests_total{")
        and 'method="POST"' in line
        and f'route="{path}"' in line
        and 'status="200"' in line
    ]
    return int(sum(counts))


def test_a_page_of_another_origin_changes_nothing_on_a_keyless_server(
    serve_batches, browser, attacker_url
):
    server = serve_batches()
    with server.http() as http:
        before = answered(http.get("/metrics").text, "/v1/completions")
    page = browser.new_page()
    page.goto(attacker_url)
    # Opaque responses: the page never reads an answer; it only needs its requests to land.
    assert page.evaluate(ATTACK, server.url) == ["opaque"] * 3
    with server.http() as http:
        assert answered(http.get("/metrics").text, "/v1/completions") == before  # no engine work
        assert http.get("/v1/organization/spend_limit").status_code == 404  # none was set
        assert http.get("/v1/files").json()["data"] == []
    assert server.blob_keys() == []

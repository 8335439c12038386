"""A real webhook receiver for tests: an HTTP server on 127.0.0.1 that records every request and
answers with the statuses a test scripts, at once or a byte at a time.

A module of its own (not conftest.py) so test modules of any package can import it.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    status: int  # what the receiver answered


class Receiver:
    """Answers each request with the next scripted status, then with `then` (200 unless set).

    `port=0` takes a free port; stopping and starting again on `receiver.port` brings a receiver
    that was down back at the same URL. With `trickle`, the answer goes out a byte at a time, that
    many seconds apart: each read is quick, the whole answer takes minutes. `peak_in_flight` is
    the most requests it was answering at once.
    """

    def __init__(
        self,
        port: int = 0,
        statuses: list[int] | None = None,
        then: int = 200,
        trickle: float | None = None,
    ):
        self._script = list(statuses or [])
        self._then = then
        self._trickle = trickle
        self._changed = threading.Condition()
        self.received: list[Received] = []
        self._in_flight = 0
        self.peak_in_flight = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def wait_for(
        self, done: Callable[[list[Received]], bool], timeout: float = 30.0
    ) -> list[Received]:
        """The requests so far, once `done(requests)` holds; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done(self.received):
                left = deadline - time.monotonic()
                assert left > 0, f"the receiver got only {self.received}"
                self._changed.wait(left)
            return list(self.received)

    def at(self, path: str) -> list[Received]:
        with self._changed:
            return [request for request in self.received if request.path == path]

    def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> int:
        with self._changed:
            status = self._script.pop(0) if self._script else self._then
            self.received.append(Received(method, path, headers, body, status))
            self._changed.notify_all()
            return status

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self._respond("POST")

            def do_GET(self) -> None:
                self._respond("GET")

            def _respond(self, method: str) -> None:
                with receiver._changed:
                    receiver._in_flight += 1
                    receiver.peak_in_flight = max(receiver.peak_in_flight, receiver._in_flight)
                try:
                    self._answer(method)
                finally:
                    with receiver._changed:
                        receiver._in_flight -= 1

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                headers = {name.lower(): value for name, value in self.headers.items()}
                status = receiver._answer(method, self.path, headers, body)
                reply = f"status {status}".encode()
                if receiver._trickle is not None:
                    self._trickle(status, reply, receiver._trickle)
                    return
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("location", receiver.url("/redirected"))
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def _trickle(self, status: int, reply: bytes, pause: float) -> None:
                self.close_connection = True
                head = f"HTTP/1.1 {status} Slow\r\ncontent-length: {len(reply)}\r\n\r\n"
                for byte in head.encode() + reply:
                    # The sender sends nothing more: the connection turning readable means it
                    # was closed, so the answer stops (and stops counting as in flight) at once.
                    closed, _, _ = select.select([self.connection], [], [], pause)
                    if closed:
                        return
                    try:
                        self.wfile.write(bytes([byte]))
                    except OSError:
                        return

            def log_message(self, *_: object) -> None:
                pass  # the test reports what it needs

        return Handler

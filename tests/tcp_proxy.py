"""A TCP proxy on loopback that a test can cut and restore.

Pointing the code under test at a service (PostgreSQL, the S3 server) through a proxy gives that
code an outage, as a restart of the service would, while the real server keeps serving every
other test and process. Cutting drops every open connection and refuses new ones; restoring
listens again on the same port.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = self._listen(0)

    def _listen(self, port: int) -> int:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return listener.getsockname()[1]

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by cut() or close()
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._connections |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self._drop(source, sink)

    def _drop(self, *sockets: socket.socket) -> None:
        for sock in sockets:
            with self._lock:
                self._connections.discard(sock)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def cut(self) -> None:
        """Refuse new connections and drop the open ones, as a service going down does."""
        if self._listener is not None:
            # Shut down first: a close alone leaves the socket listening, in the kernel, until the
            # accept() blocked on it returns, which it then never does.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            open_now = list(self._connections)
        self._drop(*open_now)

    def restore(self) -> None:
        self._listen(self.port)

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        self.cut()
        try:
            yield
        finally:
            self.restore()

    def close(self) -> None:
        self.cut()

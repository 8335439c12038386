"""A PostgreSQL cluster and a Redis server of a test's own, on free ports, that the test may stop,
kill and start again as an outage would: unlike the machine's shared ones, which every other test
and helper uses. (services.SeaweedFS is the S3 server's counterpart.)"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from glob import glob
from pathlib import Path

from servers import free_port

START_SECONDS = 30.0


def wait_for_port(port: int, alive: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + START_SECONDS
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not open port {port}") from None
            time.sleep(0.05)


class PostgresCluster:
    """`initdb` into a temporary directory, served by `pg_ctl` on a free port, trust auth."""

    def __init__(self) -> None:
        bins = sorted(glob("/usr/lib/postgresql/*/bin/initdb"))
        if not bins:
            raise RuntimeError("no PostgreSQL server binaries in /usr/lib/postgresql")
        self._bin = Path(bins[-1]).parent
        # PostgreSQL refuses to run as root: as root, the cluster belongs to `postgres`, in a
        # directory of its own (pytest's are root's alone).
        self._user = "postgres" if os.geteuid() == 0 else None
        self.root = Path(tempfile.mkdtemp(prefix="pagedbatch-pg-"))
        if self._user is not None:
            shutil.chown(self.root, self._user)
        self.port = free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self._run("initdb", "-D", str(self.root / "data"), "-U", "postgres", "--auth=trust")

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self._bin / tool), *args]
        if self._user is not None:
            command = ["runuser", "-u", self._user, "--", *command]
        subprocess.run(command, check=True, capture_output=True, cwd=self.root)

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off "
            "-c max_connections=200"
        )
        log = str(self.root / "postgres.log")
        self._run("pg_ctl", "-D", str(self.root / "data"), "-o", options, "-l", log, "-w", "start")

    def stop(self) -> None:
        """A fast shutdown: clients are disconnected, as at a restart."""
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        if (self.root / "data" / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


class RedisServer:
    """`redis-server` on a free port, keeping nothing on disk: a restart starts empty."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._log = log
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(
                ["redis-server", *args, "--appendonly", "no"], stdout=log, stderr=subprocess.STDOUT
            )
        process = self._process
        wait_for_port(self.port, lambda: process.poll() is None, "redis-server")

    def kill(self) -> None:
        assert self._process is not None
        self._process.kill()
        self._process.wait()

"""The distributed deployment through outages, on services of the test's own: Redis killed and
restarted empty, PostgreSQL stopped and restarted, the S3 server killed and restarted, and the
workers killed one after the other. The batch completes with every line exactly once, the API
never answers 500 and is back within seconds of each restart, and a replacement worker picks the
batch up within seconds."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from harness import PostgresCluster, RedisServer
from servers import (
    Deployment,
    chat_lines,
    eventually,
    kill,
    output_ids,
    running_deployment,
    wait_for_batch,
)
from services import SeaweedFS
from sqlalchemy import Select, func, select

from pagedbatch.store.db import make_engine, make_session_factory
from pagedbatch.store.models import Shard, ShardStatus, WorkerHeartbeat

LINES = 90
MAX_TOKENS = 400  # long enough that the batch outlasts the outages on an idle machine too
BACK_WITHIN_SECONDS = 5.0  # the API answers again this soon after a service restarts
RESUME_WITHIN_SECONDS = 10.0  # a replacement worker re-leases a dead one's shards, once it is up


@dataclass
class Services:
    postgres: PostgresCluster
    redis: RedisServer
    s3: SeaweedFS


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    postgres = PostgresCluster()
    redis = RedisServer(tmp_path / "redis.log")
    s3 = SeaweedFS(tmp_path / "seaweedfs")
    try:
        postgres.start()
        redis.start()
        s3.start()
        yield Services(postgres, redis, s3)
    finally:
        for stop in (s3.stop, redis.kill, postgres.remove):
            with contextlib.suppress(Exception):  # one already down must not keep the rest up
                stop()


@pytest.fixture
def deployment(services: Services, tmp_path: Path, tiny_llama: Path) -> Iterator[Deployment]:
    settings = {
        **services.s3.server.env(),
        "PAGEDBATCH_S3_BUCKET": f"test-{uuid.uuid4().hex[:16]}",
        # A shard of 10 lines at a time: the batch moves in nine steps, and is still running when
        # the last outage is over, however fast the machine.
        "PAGEDBATCH_SHARD_SIZE": "10",
        "PAGEDBATCH_WORKER_CONCURRENCY": "1",
        # Leases as long as in production: a dead worker's shards must come back through its
        # heartbeats, not through a lease lapsing.
        "PAGEDBATCH_LEASE_SECONDS": "60",
        "PAGEDBATCH_WORKER_HEARTBEAT_SECONDS": "1",
        "PAGEDBATCH_UPKEEP_INTERVAL_SECONDS": "1",
        "PAGEDBATCH_REAPER_INTERVAL_SECONDS": "2",
        "PAGEDBATCH_WORKER_METRICS_PORT": "0",
    }
    with running_deployment(
        tmp_path, tiny_llama, services.postgres.url, services.redis.url, settings
    ) as deployment:
        yield deployment


@dataclass
class Poller:
    """Asks the API for the batch every POLL_SECONDS in a thread, noting when and what it got."""

    url: str
    batch_id: str
    answers: list[tuple[float, int | str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    POLL_SECONDS = 0.2

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self.stop.wait(self.POLL_SECONDS):
                try:
                    status: int | str = http.get(f"/v1/batches/{self.batch_id}").status_code
                except httpx.TransportError as e:
                    status = type(e).__name__
                self.answers.append((time.monotonic(), status))

    def back_after(self, moment: float) -> float:
        """Seconds from `moment` to the first 200 after it."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            later = [at for at, status in self.answers if at > moment and status == 200]
            if later:
                return later[0] - moment
            time.sleep(0.05)
        raise AssertionError(f"the API did not answer after the restart: {self.answers[-5:]}")


def completed(client, batch_id: str) -> int:
    return client.batches.retrieve(batch_id).request_counts.completed


def progresses(client, batch_id: str, timeout: float = 60) -> float:
    """Waits for the batch's next finished line; returns how long that took."""
    started = time.monotonic()
    before = completed(client, batch_id)
    wait_for_batch(client, batch_id, lambda b: b.request_counts.completed > before, timeout=timeout)
    return time.monotonic() - started


@pytest.mark.slow  # about two minutes: two worker starts, three restarts, a 90-line batch
def test_a_batch_rides_out_every_outage(deployment, services):
    worker = deployment.start_worker("worker")
    client = deployment.client()
    file_id = client.files.create(file=("in.jsonl", chat_lines(LINES, MAX_TOKENS)), purpose="batch")
    batch_id = client.batches.create(
        input_file_id=file_id.id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id
    poller = Poller(deployment.url, batch_id)
    polling = threading.Thread(target=poller.run, daemon=True)
    polling.start()
    figures: dict[str, float] = {}
    began = time.monotonic()

    def note(what: str, seconds: float) -> None:
        figures[what] = seconds
        at = time.monotonic() - began
        print(f"{at:6.1f} s: {what} {seconds:.1f} s, {completed(client, batch_id)} done")

    try:
        progresses(client, batch_id)

        # Redis dies and comes back empty: the queued shard runs are gone; upkeep queues them
        # again.
        services.redis.kill()
        time.sleep(1)
        services.redis.start()
        restarted = time.monotonic()
        note("redis: API back", poller.back_after(restarted))
        note("redis: progress", progresses(client, batch_id))

        services.postgres.stop()
        time.sleep(2)
        services.postgres.start()
        restarted = time.monotonic()
        note("postgres: API back", poller.back_after(restarted))
        note("postgres: progress", progresses(client, batch_id))

        services.s3.kill()
        time.sleep(1)
        services.s3.start()
        restarted = time.monotonic()
        note("s3: API back", poller.back_after(restarted))

        # The worker, which ran upkeep, dies with shards leased for a minute; its replacement
        # finds them through the heartbeats that stopped, and runs them.
        database_url = deployment.env["PAGEDBATCH_DATABASE_URL"]
        (dead,) = heartbeats(database_url)
        kill_holding_a_lease(worker, database_url, dead)
        assert completed(client, batch_id) < LINES * 2 // 3, "the batch ran out; make it longer"
        replacement = deployment.start_worker("replacement")
        eventually(lambda: len(heartbeats(database_url)) == 2, timeout=60)
        up = time.monotonic()
        eventually(lambda: leased_to(database_url, dead) == 0, timeout=RESUME_WITHIN_SECONDS)
        note("replacement up: dead worker's shards re-leased", time.monotonic() - up)
        progresses(client, batch_id)
        note("replacement up: progress", time.monotonic() - up)

        batch = wait_for_batch(client, batch_id, lambda b: b.status in {"completed", "failed"})
        note("replacement up: batch completed", time.monotonic() - up)
    finally:
        poller.stop.set()
        polling.join()
    assert batch.status == "completed", batch
    ids = output_ids(client, batch.output_file_id)
    assert sorted(ids) == sorted(f"r{i}" for i in range(LINES))  # each exactly once
    assert batch.request_counts.completed == LINES and batch.request_counts.failed == 0
    statuses = {status for _, status in poller.answers}
    assert statuses <= {200, 503}, statuses
    assert all(v < BACK_WITHIN_SECONDS for k, v in figures.items() if "API back" in k), figures
    assert replacement.poll() is None


def kill_holding_a_lease(worker, database_url: str, worker_id: str) -> None:
    """`kill -9` of the worker at a moment it holds a shard: between two shards it holds none.
    The worker is frozen while its leases are counted, so it cannot let go in between."""
    deadline = time.monotonic() + 60
    while True:
        os.killpg(worker.pid, signal.SIGSTOP)
        if leased_to(database_url, worker_id) > 0:
            kill(worker)
            return
        os.killpg(worker.pid, signal.SIGCONT)
        assert time.monotonic() < deadline, "the worker never held a shard"
        time.sleep(0.2)


def query(database_url: str, statement: Select) -> list:
    engine = make_engine(database_url)
    try:
        with make_session_factory(engine)() as session:
            return list(session.scalars(statement))
    finally:
        engine.dispose()


def heartbeats(database_url: str) -> list[str]:
    return query(database_url, select(WorkerHeartbeat.worker_id))


def leased_to(database_url: str, worker_id: str) -> int:
    running = (Shard.status == ShardStatus.RUNNING) & (Shard.lease_owner == worker_id)
    return query(database_url, select(func.count()).select_from(Shard).where(running))[0]

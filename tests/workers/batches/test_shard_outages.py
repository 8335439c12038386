"""Shards and finalization against a job store and blob store that go away for a while: the
worker reaches PostgreSQL (and S3) through a proxy the test cuts, while the real servers keep
serving everyone else. Whatever happens, every line ends in exactly one file, once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest
from batch_worker import (
    batch,
    chat_line,
    file_lines,
    finalized,
    pending_requests,
    run_all_shards,
    shard_states,
    submit,
)
from servers import eventually
from sqlalchemy import select, update
from tcp_proxy import TcpProxy

from pagedbatch.store.blobs import S3BlobStore
from pagedbatch.store.db import transaction
from pagedbatch.store.models import BatchStatus, Shard, ShardStatus
from pagedbatch.workers.batches.finalize import finalize_batch
from pagedbatch.workers.batches.shards import run_shard


class Background(threading.Thread):
    """`work()` in a thread, keeping what it raised."""

    def __init__(self, work: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.work = work
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.work()
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            self.error = e

    def finish(self, timeout: float) -> None:
        self.join(timeout)
        assert not self.is_alive(), f"still running after {timeout} s"
        if self.error is not None:
            raise self.error


@pytest.fixture
def database_proxy() -> Iterator[TcpProxy]:
    proxy = TcpProxy("127.0.0.1", 5432)
    yield proxy
    proxy.close()


def retried(caplog: pytest.LogCaptureFixture, what: str) -> bool:
    """Whether a retry of `what` was logged: the outage did hit it."""
    return any("retrying" in r.getMessage() and what in r.getMessage() for r in caplog.records)


def test_a_database_outage_mid_shard_is_ridden_out(make_batch_worker, database_proxy, caplog):
    caplog.set_level(logging.WARNING)
    # The lease is renewed each third of it, so an outage that starts just before a renewal has
    # two thirds of the lease to end in: 8 s, well past the outage's 4 s at most plus reconnecting
    # on a loaded machine.
    worker = make_batch_worker(database_port=database_proxy.port, lease_seconds=12)
    observer = make_batch_worker()  # reaches the database directly
    # Lines that end one after another, so that some end while the database is away: 160 tokens
    # apart, a few tenths of a second on a fast machine, which the outage outlasts.
    lines = [chat_line(f"l{i}", max_tokens=32 + 160 * i, ignore_eos=True) for i in range(10)]
    batch_id = submit(worker, lines)
    shard = Background(lambda: run_shard(worker.ctx))
    eventually(lambda: batch(observer, batch_id).request_completed >= 1, timeout=20)
    # Away until a write of results has failed (lines keep ending, and their results are flushed
    # within result_flush_ms), and for less than the lease.
    with database_proxy.outage():
        eventually(lambda: retried(caplog, "recording"), timeout=4)
    shard.finish(60)
    assert shard_states(observer, batch_id) == [ShardStatus.DONE]
    ended, results = finalized(worker, batch_id)
    assert ended.status == BatchStatus.COMPLETED
    assert (ended.request_completed, ended.request_failed) == (10, 0)
    assert sorted(results) == sorted(line["custom_id"] for line in lines)
    assert all(line["response"]["status_code"] == 200 for line in results.values())


def test_a_lease_that_cannot_be_renewed_stops_the_shard_for_a_retry(
    make_batch_worker, database_proxy
):
    worker = make_batch_worker(database_port=database_proxy.port, lease_seconds=2)
    observer = make_batch_worker()
    lines = [chat_line(f"l{i}", max_tokens=400, ignore_eos=True) for i in range(6)]
    batch_id = submit(worker, lines)
    shard = Background(lambda: run_shard(worker.ctx))
    eventually(lambda: shard_states(observer, batch_id) == [ShardStatus.RUNNING], timeout=20)
    time.sleep(0.5)  # the lines are in the engine
    with database_proxy.outage():
        # Before its lease lapses the shard stops: its lines are aborted and left pending.
        shard.finish(4)
    assert pending_requests(observer, batch_id) == len(lines)

    # The lease lapses; the reaper puts the shard back and another run does the work.
    def reaped() -> bool:
        with transaction(observer.ctx.session_factory) as session:
            return (
                session.execute(
                    update(Shard)
                    .where(Shard.batch_id == batch_id, Shard.lease_expires_at < time.time())
                    .values(status=ShardStatus.PENDING, lease_owner=None, lease_expires_at=None)
                ).rowcount
                == 1
            )

    eventually(reaped, timeout=5)
    run_all_shards(observer, batch_id)
    with observer.ctx.session_factory() as session:
        assert session.scalars(select(Shard.attempts).where(Shard.batch_id == batch_id)).all() == [
            2
        ]
    ended, results = finalized(observer, batch_id)
    assert ended.status == BatchStatus.COMPLETED
    assert (ended.request_completed, ended.request_failed) == (len(lines), 0)
    assert len(results) == len(lines)


@pytest.fixture
def s3_proxy(s3_server) -> Iterator[TcpProxy]:
    address = urlsplit(s3_server.endpoint_url)
    proxy = TcpProxy(address.hostname, address.port)
    yield proxy
    proxy.close()


def test_finalization_rides_out_database_and_storage_outages(
    make_batch_worker, database_proxy, s3_proxy, s3_settings_env
):
    blobs = S3BlobStore(s3_settings_env, f"http://127.0.0.1:{s3_proxy.port}")
    worker = make_batch_worker(database_port=database_proxy.port, blobs=blobs)
    lines = [chat_line(f"l{i}") for i in range(3)]
    batch_id = submit(worker, lines)
    run_all_shards(worker, batch_id)
    database_proxy.cut()
    s3_proxy.cut()
    finalization = Background(lambda: finalize_batch(worker.ctx, batch_id))
    time.sleep(1.0)
    database_proxy.restore()  # finalization gets as far as writing the files, and waits
    time.sleep(1.0)
    s3_proxy.restore()
    finalization.finish(60)
    ended = batch(worker, batch_id)
    assert ended.status == BatchStatus.COMPLETED
    assert sorted(file_lines(worker, batch_id)) == ["l0", "l1", "l2"]


def test_a_failed_finalization_records_nothing_and_can_run_again(make_batch_worker):
    worker = make_batch_worker()
    batch_id = submit(worker, [chat_line("a"), chat_line("b")])
    run_all_shards(worker, batch_id)
    # Storage refuses the files (not an outage: a file stands where their directory goes).
    in_the_way = worker.ctx.blobs.root / "batches" / batch_id
    in_the_way.parent.mkdir(parents=True, exist_ok=True)
    in_the_way.write_bytes(b"")
    with pytest.raises(FileExistsError):
        finalize_batch(worker.ctx, batch_id)
    failed = batch(worker, batch_id)
    assert failed.status == BatchStatus.FINALIZING
    assert (failed.output_file_id, failed.error_file_id) == (None, None)
    # The next try (upkeep's) need not wait for the failed one's claim to go stale.
    in_the_way.unlink()
    ended, results = finalized(worker, batch_id)
    assert ended.status == BatchStatus.COMPLETED
    assert sorted(results) == ["a", "b"]

"""A shard writes its results a flush at a time: one transaction for many lines, when enough
lines wait or the oldest has waited long enough. Whatever becomes of the worker, every line is
written once: a dead worker's flushed lines are kept, its buffered ones redone, and a worker
that lost its lease writes nothing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from batch_worker import (
    Worker,
    batch,
    chat_line,
    finalized,
    pending_requests,
    run_all_shards,
    shard_states,
    submit,
)
from sqlalchemy import event, select, update
from test_shard_outages import Background, database_proxy, eventually  # noqa: F401 - a fixture

from pagedbatch.store.db import transaction
from pagedbatch.store.models import BatchRequest, BatchStatus, Shard, ShardStatus, UsageRecord
from pagedbatch.workers.batches.shards import run_shard
from pagedbatch.workers.periodic import reap_leases

MINUTE_MS = 60_000  # a flush timer that never fires during a test


class Flushes:
    """The flushes a worker made: how many lines each wrote, seen on its database connection."""

    def __init__(self, worker: Worker) -> None:
        self.sizes: list[int] = []
        event.listen(worker.database, "after_cursor_execute", self._seen)

    def _seen(self, conn, cursor, statement: str, parameters, context, executemany) -> None:
        if statement.startswith("UPDATE batch_requests SET status"):
            self.sizes.append(len(parameters) if executemany else 1)


def long_line(custom_id: str) -> dict[str, Any]:
    """A line that keeps its shard running for seconds after the short ones ended."""
    return chat_line(custom_id, max_tokens=600, ignore_eos=True)


def short_lines(count: int) -> list[dict[str, Any]]:
    """Lines that end one after another, a few engine steps apart."""
    return [chat_line(f"s{i}", max_tokens=4 * (i + 1), ignore_eos=True) for i in range(count)]


def running_in_engine(worker: Worker) -> int:
    return asyncio.run(worker.ctx.engine.get_stats())["running"]


def recorded(worker: Worker, batch_id: str) -> dict[str, dict[str, Any]]:
    """The lines written so far: their output lines, by custom_id."""
    with worker.ctx.session_factory() as session:
        rows = session.execute(
            select(BatchRequest.custom_id, BatchRequest.result).where(
                BatchRequest.batch_id == batch_id, BatchRequest.status != "pending"
            )
        ).all()
    return dict(rows)


def test_a_flush_writes_as_soon_as_enough_lines_wait(make_batch_worker):
    worker = make_batch_worker(result_flush_lines=3, result_flush_ms=MINUTE_MS)
    observer = make_batch_worker()
    batch_id = submit(worker, [*short_lines(7), long_line("long")])
    flushes = Flushes(worker)
    shard = Background(lambda: run_shard(worker.ctx))
    # Long before the timer, three short lines are written together while the long one runs.
    eventually(lambda: batch(observer, batch_id).request_completed >= 3)
    assert shard.is_alive()
    shard.finish(60)
    assert sum(flushes.sizes) == 8 and len(flushes.sizes) >= 2
    # Every flush but the one at the shard's end waited for three lines; none wrote one alone.
    assert all(size >= 3 for size in flushes.sizes[:-1]), flushes.sizes
    ended, results = finalized(worker, batch_id)
    assert (ended.request_completed, ended.request_failed) == (8, 0)
    assert len(results) == 8


def test_a_flush_writes_what_has_waited_long_enough(make_batch_worker):
    worker = make_batch_worker(result_flush_lines=1000, result_flush_ms=200)
    observer = make_batch_worker()
    batch_id = submit(worker, [*short_lines(3), long_line("long")])
    flushes = Flushes(worker)
    shard = Background(lambda: run_shard(worker.ctx))
    # Far fewer than a thousand lines wait, yet the short ones are written while the long runs.
    eventually(lambda: batch(observer, batch_id).request_completed == 3)
    assert shard.is_alive() and running_in_engine(worker) == 1
    shard.finish(60)
    assert sum(flushes.sizes) == 4 and flushes.sizes[-1] == 1  # the long line, at the end
    assert batch(observer, batch_id).request_completed == 4


def test_a_worker_killed_between_flushes_loses_and_duplicates_nothing(
    make_batch_worker,
    database_proxy,  # noqa: F811 - the fixture
):
    doomed = make_batch_worker(
        database_port=database_proxy.port,
        lease_seconds=2,
        result_flush_lines=2,
        result_flush_ms=MINUTE_MS,
    )
    doomed.ctx.worker_id = "doomed"
    replacement = make_batch_worker(lease_seconds=2)
    lines = [*short_lines(3), long_line("long-1"), long_line("long-2")]
    batch_id = submit(replacement, lines)
    shard = Background(lambda: run_shard(doomed.ctx))
    # Two short lines are flushed; the third waits in the buffer for a second line to join it.
    eventually(lambda: len(recorded(replacement, batch_id)) == 2)
    eventually(lambda: running_in_engine(doomed) == 2)  # the long lines: the third has ended
    time.sleep(0.3)  # time enough for a third line's flush, were one due
    flushed = recorded(replacement, batch_id)
    assert sorted(flushed) == ["s0", "s1"]
    # The worker dies: to the job store it is gone at once, and it writes nothing more.
    database_proxy.cut()
    shard.finish(10)  # its lease could not be renewed: it stopped (a dead one just stops)
    assert recorded(replacement, batch_id) == flushed

    # Its lease lapses; the reaper hands the shard out again and the replay does the rest.
    def reaped() -> bool:
        reap_leases(replacement.ctx)
        return shard_states(replacement, batch_id) == [ShardStatus.PENDING]

    eventually(reaped, timeout=10)
    run_all_shards(replacement, batch_id)
    ended, results = finalized(replacement, batch_id)
    assert ended.status == BatchStatus.COMPLETED
    assert sorted(results) == sorted(line["custom_id"] for line in lines)  # each once
    assert (ended.request_completed, ended.request_failed) == (len(lines), 0)
    # The flushed lines were not run again, and nothing was counted twice.
    assert {custom_id: results[custom_id] for custom_id in flushed} == flushed
    usage = [line["response"]["body"]["usage"] for line in results.values()]
    assert ended.output_tokens == sum(u["completion_tokens"] for u in usage)
    assert ended.input_tokens == sum(u["prompt_tokens"] for u in usage)
    # The usage ledger too: a record per line, written with its result, so once.
    with replacement.ctx.session_factory() as session:
        ledger = session.scalars(
            select(UsageRecord.output_tokens).where(UsageRecord.batch_id == batch_id)
        ).all()
    assert (len(ledger), sum(ledger)) == (len(lines), ended.output_tokens)


def test_a_flush_after_the_lease_was_lost_writes_nothing(make_batch_worker):
    worker = make_batch_worker(result_flush_lines=1000, result_flush_ms=MINUTE_MS)
    lines = [*short_lines(2), long_line("long")]
    batch_id = submit(worker, lines)
    shard = Background(lambda: run_shard(worker.ctx))
    eventually(lambda: shard_states(worker, batch_id) == [ShardStatus.RUNNING])
    # The reaper took the shard and another worker leased it while this one ran its lines.
    with transaction(worker.ctx.session_factory) as session:
        session.execute(
            update(Shard).where(Shard.batch_id == batch_id).values(lease_owner="another worker")
        )
    shard.finish(60)  # its flush, at the end, found the lease gone
    assert pending_requests(worker, batch_id) == len(lines)
    assert batch(worker, batch_id).request_completed == 0
    with worker.ctx.session_factory() as session:
        left = session.execute(
            select(Shard.status, Shard.lease_owner).where(Shard.batch_id == batch_id)
        ).one()
    assert tuple(left) == (ShardStatus.RUNNING, "another worker")  # not marked done either

"""A process that shuts down does not wait for its running shards to end: each stops within a
watcher's tick and hands its shard back, pending, with the lines it finished kept and the attempt
not counted, and asks for a run of it elsewhere. The next run finishes the batch, every line once.
"""

from __future__ import annotations

import threading
import time

from batch_worker import (
    chat_line,
    finalized,
    pending_requests,
    run_all_shards,
    shard_states,
    submit,
)
from sqlalchemy import select

from pagedbatch.store.models import BatchStatus, Shard, ShardStatus
from pagedbatch.workers.batches.shards import run_shard
from pagedbatch.workers.leases import STOP_CHECK_SECONDS

LINES = 6


def attempts(worker, batch_id: str) -> int:
    with worker.ctx.session_factory() as session:
        return session.scalar(select(Shard.attempts).where(Shard.batch_id == batch_id))


def test_a_shutdown_hands_the_running_shard_back_and_the_next_run_finishes_it(make_batch_worker):
    # One shard: short lines that finish at once, long ones that outlast the test's wait (and fit
    # the engine's cache together).
    worker = make_batch_worker(shard_size=LINES)
    lines = [
        chat_line(f"r{i}", max_tokens=1000 if i % 2 else 2, ignore_eos=True) for i in range(LINES)
    ]
    batch_id = submit(worker, lines)

    running = threading.Thread(target=run_shard, args=(worker.ctx,))
    running.start()
    deadline = time.monotonic() + 30
    while pending_requests(worker, batch_id) == LINES:  # wait for a first line to finish
        assert time.monotonic() < deadline, "no line finished"
        time.sleep(0.05)
    worker.ctx.stopping.set()
    stopped_at = time.monotonic()
    running.join(30)
    assert not running.is_alive()
    assert time.monotonic() - stopped_at < 4 * STOP_CHECK_SECONDS + 2

    assert shard_states(worker, batch_id) == [ShardStatus.PENDING]
    assert attempts(worker, batch_id) == 0
    left = pending_requests(worker, batch_id)
    assert 0 < left < LINES
    assert ("run_shard", ()) in worker.queued

    worker.ctx.stopping.clear()
    run_all_shards(worker, batch_id)
    ended, results = finalized(worker, batch_id)
    assert ended.status == BatchStatus.COMPLETED
    assert (ended.request_completed, ended.request_failed) == (LINES, 0)
    assert sorted(results) == sorted(f"r{i}" for i in range(LINES))

"""Running shards: claiming one fairly, running its requests on this worker's engine, keeping the
lease alive, and stopping at once when the batch is cancelled or expires.

A `run_shard` task is not bound to a shard: it claims whichever pending shard is fairest when it
starts. Tenants with the fewest running shards go first, so a small batch is not stuck behind
another tenant's large one; within a tenant, older batches go first.

Results are written many lines to a transaction (`_ResultWriter`): with one a line, the job
store's commits rather than the engine would bound a fast engine. Each line reserves its worst
case against the spend limits before it runs, and settles in the flush that writes its result
(line_spend.py).

Failures stay as small as they can: a line that cannot be run is that line's error line; a
database outage is ridden out (writes are idempotent, so they are simply retried) and a lease
that cannot be renewed in time stops the shard, which the reaper hands out again; a shard that
has failed `max_shard_attempts` times fails its remaining lines rather than run once more. A
process that shuts down hands its running shards back at once: their unfinished lines wait for
the next worker, which need not wait for a lease to lapse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from pagedbatch.engine.async_llm import EngineDeadError
from pagedbatch.protocol.batch_lines import (
    failed_line,
    response_line,
)
from pagedbatch.protocol.pipeline import RequestContext, RequestPipeline, unless
from pagedbatch.protocol.schemas.common import Usage
from pagedbatch.store.batches import (
    LineResult,
    fail_pending,
    holds_lease,
    record_results,
    stopping,
    unfinished_shards,
)
from pagedbatch.store.db import transaction
from pagedbatch.store.models import (
    Batch,
    BatchRequest,
    BatchStatus,
    RequestStatus,
    Shard,
    ShardStatus,
)
from pagedbatch.store.reservations import Settlement
from pagedbatch.store.retry import retrying
from pagedbatch.workers.batches.endpoints import Endpoint, endpoint
from pagedbatch.workers.batches.line_spend import LineSpend
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.leases import Lease
from pagedbatch.workers.metrics import BATCH_REQUESTS

logger = logging.getLogger(__name__)


@dataclass
class ClaimedShard:
    id: int
    batch_id: str
    index: int
    endpoint: str
    owner: str
    leased_until: float  # time.monotonic() by which the lease must be renewed


@dataclass
class _Look:
    """One look for a shard to claim."""

    claimed: ClaimedShard | None = None
    none_pending: bool = False
    retired_batch: str | None = None  # a shard of it was out of attempts and failed instead
    failed_lines: int = 0  # the retired shard's


def claim_shard(ctx: WorkerContext) -> ClaimedShard | None:
    """Lease the fairest pending shard of a running batch, or None if there is none.

    A shard already claimed `max_shard_attempts` times is not run again (each attempt crashed its
    worker or lost its lease): its unfinished lines fail, and the look goes on.
    """
    while True:
        look = retrying(lambda: _look_for_shard(ctx), "claiming a shard")
        if look.retired_batch is not None:
            BATCH_REQUESTS.labels("failed").inc(look.failed_lines)
            _finalize_when_done(ctx, look.retired_batch)
        elif look.claimed is not None or look.none_pending:
            return look.claimed
        # Another worker took it first, or it was retired: look again.


def _look_for_shard(ctx: WorkerContext) -> _Look:
    with transaction(ctx.session_factory) as session:
        pending = (
            select(
                Shard.id,
                Shard.owner,
                Shard.batch_id,
                Shard.index,
                Shard.attempts,
                Batch.endpoint,
                Batch.created_at,
            )
            .join(Batch, Batch.id == Shard.batch_id)
            .where(Shard.status == ShardStatus.PENDING, Batch.status == BatchStatus.IN_PROGRESS)
        )
        candidates = session.execute(pending.order_by(Batch.created_at, Shard.index)).all()
        if not candidates:
            return _Look(none_pending=True)
        running = dict(
            session.execute(
                select(Shard.owner, func.count())
                .where(Shard.status == ShardStatus.RUNNING)
                .group_by(Shard.owner)
            ).all()
        )
        # First candidate of the least busy tenant; candidates are already oldest first.
        best = min(candidates, key=lambda c: running.get(c.owner, 0))
        if best.attempts >= ctx.settings.max_shard_attempts:
            failed = _retire(session, best.id, best.batch_id, best.index, best.attempts)
            if failed is None:
                return _Look()
            return _Look(retired_batch=best.batch_id, failed_lines=failed)
        leased_until = time.monotonic() + ctx.settings.lease_seconds
        claimed = session.execute(
            update(Shard)
            .where(Shard.id == best.id, Shard.status == ShardStatus.PENDING)
            .values(
                status=ShardStatus.RUNNING,
                lease_owner=ctx.worker_id,
                lease_expires_at=time.time() + ctx.settings.lease_seconds,
                attempts=Shard.attempts + 1,
            )
        )
        if claimed.rowcount != 1:
            return _Look()
        return _Look(
            claimed=ClaimedShard(
                best.id, best.batch_id, best.index, best.endpoint, best.owner, leased_until
            )
        )


def _retire(
    session: Session, shard_id: int, batch_id: str, index: int, attempts: int
) -> int | None:
    """Mark a pending shard done, failing its unfinished lines: how many; None if another
    worker got to it first."""
    taken = session.execute(
        update(Shard)
        .where(Shard.id == shard_id, Shard.status == ShardStatus.PENDING)
        .values(status=ShardStatus.DONE, lease_owner=None, lease_expires_at=None)
    )
    if taken.rowcount != 1:
        return None
    error = {
        "code": "shard_failed",
        "message": f"This request was not completed: the work on it was tried {attempts} "
        "times and failed each time.",
    }
    failed = fail_pending(session, batch_id, index, error)
    logger.error(
        "shard %s of %s failed %d times: not retrying it; %d request(s) failed",
        index,
        batch_id,
        attempts,
        failed,
    )
    return failed


def _finalize_when_done(ctx: WorkerContext, batch_id: str, told_to_stop: bool = False) -> None:
    """Queue the batch's finalization if no shard of it is left, or it was told to stop.

    Counted after the shard's end committed: two shards ending at once must not both miss the
    other. A batch told to stop is finalized too, even if this shard ended before it noticed: a
    finalization that ran meanwhile saw this shard running and left it to this one.
    """

    def should_finalize() -> bool:
        with ctx.session_factory() as session:
            remaining = unfinished_shards(session, batch_id)
            batch = session.get(Batch, batch_id)
            return remaining == 0 or (batch is not None and stopping(batch))

    if told_to_stop or retrying(should_finalize, "counting a batch's unfinished shards"):
        retrying(lambda: ctx.queue.enqueue("finalize_batch", batch_id), "queueing a finalization")


def run_shard(ctx: WorkerContext) -> None:
    if ctx.engine is None:
        raise RuntimeError("run_shard needs a worker with an engine")
    with ctx.shard_slots:
        shard = claim_shard(ctx)
        if shard is None:
            return
        served = endpoint(ctx, shard.endpoint)
        if served is None:  # its lease lapses: a worker that has the engine takes it
            raise RuntimeError(f"this worker has no engine for {shard.endpoint} batches")
        logger.info("running shard %s of %s", shard.index, shard.batch_id)
        asyncio.run(_ShardRun(ctx, served, shard).run())


class _ShardRun:
    def __init__(self, ctx: WorkerContext, served: Endpoint, shard: ClaimedShard):
        self.ctx = ctx
        self.engine = engine = served.engine
        self.prepare = served.prepare
        self.shard = shard
        self.lease = Lease(
            f"shard {shard.index} of {shard.batch_id}",
            shard.leased_until,
            ctx.settings.lease_seconds,
            self._look,
            ctx.stopping,
            renew_after_stop=True,  # what is buffered is written once it stops, under the lease
        )
        # Up to an engine's worth of lines each: the engine runs max_num_seqs at once and queues
        # the rest by arrival, so the lines of concurrent shards take turns, and a shard running
        # alone, or the others while one drains its last lines, still fill every seat.
        self.in_flight = asyncio.Semaphore(engine.engine.args.max_num_seqs)
        self.spend = LineSpend(ctx, shard.owner, engine.engine.model_name)
        self.results = _ResultWriter(ctx, shard, self.lease, self.spend)
        # Each line names itself by its custom_id in the content filter's log lines.
        self.context = RequestContext.of(
            ctx.settings,
            shard.owner,
            door="batch",
            guard=ctx.guard,
            moderation=engine is ctx.guard,
        )

    async def run(self) -> None:
        requests = retrying(self._pending_requests, "reading a shard's requests")
        async with self.lease.kept():
            writer = asyncio.create_task(self.results.run())
            writer.add_done_callback(self._stop_if_failed)
            try:
                await asyncio.gather(*(self._run_request(r) for r in requests))
            finally:
                # What is buffered is written, however the lines ended (done, stopped, or the
                # engine died), and under the lease: it is kept till then.
                self.results.close()
                await writer
                await asyncio.to_thread(self.spend.release_rest)
        if self.lease.lost:
            logger.warning(
                "lost the lease of shard %s of %s: left to the reaper",
                self.shard.index,
                self.shard.batch_id,
            )
            return
        if self.lease.handing_back:
            retrying(self._hand_back, "handing a shard back")
            logger.info(
                "shutting down: handed shard %s of %s back", self.shard.index, self.shard.batch_id
            )
            # For another worker; a queue that has stopped takes nothing, and the next start
            # queues the shard again (resume_work).
            retrying(lambda: self.ctx.queue.enqueue("run_shard"), "queueing a shard run")
            return
        retrying(self._mark_done, "marking a shard done")
        _finalize_when_done(self.ctx, self.shard.batch_id, told_to_stop=self.lease.stop.is_set())

    def _pending_requests(self) -> list[BatchRequest]:
        with self.ctx.session_factory() as session:
            return list(
                session.scalars(
                    select(BatchRequest)
                    .where(
                        BatchRequest.batch_id == self.shard.batch_id,
                        BatchRequest.shard_index == self.shard.index,
                        BatchRequest.status == RequestStatus.PENDING,
                    )
                    .order_by(BatchRequest.line)
                ).all()
            )

    def _release(self, status: ShardStatus, **values: Any) -> None:
        """Give up the lease (if still held), leaving the shard `status`."""
        with transaction(self.ctx.session_factory) as session:
            session.execute(
                update(Shard)
                .where(Shard.id == self.shard.id, Shard.lease_owner == self.ctx.worker_id)
                .values(status=status, lease_owner=None, lease_expires_at=None, **values)
            )

    def _mark_done(self) -> None:
        self._release(ShardStatus.DONE)

    def _hand_back(self) -> None:
        """Make the shard pending again. Not an attempt that failed: its count is undone."""
        self._release(ShardStatus.PENDING, attempts=Shard.attempts - 1)

    def _look(self, renew: bool) -> tuple[bool, bool]:
        """Whether the batch is stopping, and whether the lease was renewed (only if `renew`).
        A look that renews nothing commits nothing: there are two a second per shard."""
        with self.ctx.session_factory() as session:
            batch = session.get(Batch, self.shard.batch_id)
            told_to_stop = batch is None or stopping(batch)
            if not renew:
                return told_to_stop, False
            renewed = session.execute(
                update(Shard)
                .where(Shard.id == self.shard.id, Shard.lease_owner == self.ctx.worker_id)
                .values(lease_expires_at=time.time() + self.ctx.settings.lease_seconds)
            )
            session.commit()
            return told_to_stop, renewed.rowcount == 1

    def _stop_if_failed(self, writer: asyncio.Task[None]) -> None:
        """A writer that failed (an outage outlasting its retries) stops the lines: their
        results could not be written anyway. `run` raises its error once they have stopped."""
        if not writer.cancelled() and writer.exception() is not None:
            self.lease.stop.set()

    async def _run_request(self, request: BatchRequest) -> None:
        async with self.in_flight:
            if self.lease.stop.is_set():
                return  # left pending: finalization marks it cancelled or expired
            try:
                answered = await self._respond(request)
            except EngineDeadError:
                raise  # the worker's failure, not the line's: the shard runs again elsewhere
            except Exception as e:  # noqa: BLE001 - whatever it is, it is this line's failure
                line = failed_line(request.custom_id, e).model_dump(mode="json")
                self.results.add(LineResult(request.id, RequestStatus.FAILED, line))
                return
            if answered is None:
                return  # stopped mid-way
            body, used = answered
            line = response_line(request.custom_id, 200, body).model_dump(mode="json")
            tokens: dict[str, int] = {}  # the moderation engine's lines are free: none counted
            if used is not None:
                details = used.prompt_tokens_details
                tokens = {
                    "prompt_tokens": used.prompt_tokens,
                    "cached_tokens": details.cached_tokens,
                    "completion_tokens": used.completion_tokens,
                    "image_tokens": details.image_tokens,
                    "audio_tokens": details.audio_tokens,
                }
            self.results.add(LineResult(request.id, RequestStatus.SUCCEEDED, line, **tokens))

    async def _respond(self, request: BatchRequest) -> tuple[dict[str, Any], Usage | None] | None:
        """The line's response body and what it used; None if the shard was told to stop.
        Raises OpenAIError with what the endpoint would have answered instead, or whatever else
        went wrong."""
        # On a thread: decoding a line's images or clips takes long enough to hold up the others.
        prepared = await asyncio.to_thread(self.prepare, request.body, self.engine.engine)
        # Before any engine work; a 429 insufficient_quota fails this line alone.
        await asyncio.to_thread(self.spend.reserve, request.id, self.engine.engine, prepared)
        # Unique per attempt: a retried shard may overlap a lost one in this engine.
        attempt = uuid.uuid4().hex[:8]
        prepared.inputs = [
            replace(i, request_id=f"{i.request_id}-{attempt}") for i in prepared.inputs
        ]
        pipeline = RequestPipeline(
            self.engine, prepared, replace(self.context, request_id=request.custom_id)
        )
        return await unless(pipeline.batch_line(), self.lease.stop.wait())


class _ResultWriter:
    """A shard's finished lines on their way to the job store, a flush at a time: one transaction
    that records every line buffered and bumps the batch's counters once. A flush starts when
    `result_flush_lines` lines wait or the oldest has waited `result_flush_ms`, whichever comes
    first, and once more at the end (`close`) for whatever is left. Flushes run one after
    another, in a thread, riding out database outages; `request_counts` move a flush at a time.

    Exactly once through crashes: a line is done only once its flush commits. A worker killed
    before that leaves the line pending, and the shard's next run does it again; killed after,
    the next run skips it. A flush writes only while this worker holds the shard's lease
    (checked, and the shard's row locked, in the flush's own transaction) and only lines still
    pending, counting exactly those: a retried flush, a replayed shard's, or one that lost the
    lease to another worker writes and counts nothing twice.
    """

    def __init__(
        self,
        ctx: WorkerContext,
        shard: ClaimedShard,
        lease: Lease,
        spend: LineSpend,
    ) -> None:
        self.ctx = ctx
        self.shard = shard
        self.lease = lease
        self.spend = spend
        self.flush_lines = ctx.settings.result_flush_lines
        self.flush_seconds = ctx.settings.result_flush_ms / 1000
        self.buffer: list[LineResult] = []
        self.oldest = 0.0  # the event loop's time when the oldest line in the buffer came
        self.closed = False
        self.waiting = asyncio.Event()  # set: a line is buffered, or closed
        self.due = asyncio.Event()  # set: a flush's worth of lines is buffered, or closed

    def add(self, result: LineResult) -> None:
        if not self.buffer:
            self.oldest = asyncio.get_running_loop().time()
            self.waiting.set()
        self.buffer.append(result)
        if len(self.buffer) >= self.flush_lines:
            self.due.set()

    def close(self) -> None:
        """No more lines are coming: flush what is buffered now, and end `run`."""
        self.closed = True
        self.waiting.set()
        self.due.set()

    async def run(self) -> None:
        while self.buffer or not self.closed:
            await self.waiting.wait()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(self.oldest + self.flush_seconds):
                    await self.due.wait()
            results, self.buffer = self.buffer, []
            if not self.closed:
                self.waiting.clear()
                self.due.clear()
            if results:
                await self._flush(results)

    async def _flush(self, results: list[LineResult]) -> None:
        def write() -> tuple[list[LineResult], dict[int, Settlement]] | None:
            if self.lease.lost:  # also between retries: the next run does these lines
                return None
            with transaction(self.ctx.session_factory) as session:
                if not holds_lease(session, self.shard.id, self.ctx.worker_id):
                    return None
                written = record_results(session, self.shard.batch_id, results)
                return written, self.spend.settle(session, results, written)

        what = f"recording {len(results)} results of {self.shard.batch_id}"
        done = await asyncio.to_thread(retrying, write, what)
        if done is None:
            self.lease.lose()  # the reaper took the shard: another worker may be running it
            return
        written, settlements = done
        self.spend.settled(settlements)
        succeeded = sum(r.status == RequestStatus.SUCCEEDED for r in written)
        BATCH_REQUESTS.labels("completed").inc(succeeded)
        BATCH_REQUESTS.labels("failed").inc(len(written) - succeeded)

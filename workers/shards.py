"""Running shards: claiming one fairly, running its requests on this worker's engine, keeping the
lease alive, and stopping at once when the batch is cancelled or expires.

A `run_shard` task is not bound to a shard: it claims whichever pending shard is fairest when it
starts. Tenants with the fewest running shards go first, so a small batch is not stuck behind
another tenant's large one; within a tenant, older batches go first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update

from pagedbatch.api.errors import OpenAIError
from pagedbatch.api.serving.common import BATCH_PRIORITY, Prepared
from pagedbatch.engine import AsyncLLM
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.store.batches import record_result, stopping, unfinished_shards
from pagedbatch.store.db import transaction
from pagedbatch.store.models import (
    Batch,
    BatchRequest,
    BatchStatus,
    RequestStatus,
    Shard,
    ShardStatus,
)
from pagedbatch.workers.batch_runner import (
    ENDPOINTS,
    openai_error_line,
    response_line,
)
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.metrics import BATCH_REQUESTS

logger = logging.getLogger(__name__)

STOP_CHECK_SECONDS = 0.5  # how soon a cancel reaches the engine


@dataclass
class ClaimedShard:
    id: int
    batch_id: str
    index: int
    endpoint: str


def claim_shard(ctx: WorkerContext) -> ClaimedShard | None:
    """Lease the fairest pending shard of a running batch, or None if there is none."""
    while True:
        with transaction(ctx.session_factory) as session:
            pending = (
                select(
                    Shard.id,
                    Shard.owner,
                    Shard.batch_id,
                    Shard.index,
                    Batch.endpoint,
                    Batch.created_at,
                )
                .join(Batch, Batch.id == Shard.batch_id)
                .where(Shard.status == ShardStatus.PENDING, Batch.status == BatchStatus.IN_PROGRESS)
            )
            candidates = session.execute(pending.order_by(Batch.created_at, Shard.index)).all()
            if not candidates:
                return None
            running = dict(
                session.execute(
                    select(Shard.owner, func.count())
                    .where(Shard.status == ShardStatus.RUNNING)
                    .group_by(Shard.owner)
                ).all()
            )
            # First candidate of the least busy tenant; candidates are already oldest first.
            best = min(candidates, key=lambda c: running.get(c.owner, 0))
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
            if claimed.rowcount == 1:
                return ClaimedShard(best.id, best.batch_id, best.index, best.endpoint)
        # Another worker took it first: look again.


def run_shard(ctx: WorkerContext) -> None:
    if ctx.engine is None:
        raise RuntimeError("run_shard needs a worker with an engine")
    with ctx.shard_slots:
        shard = claim_shard(ctx)
        if shard is None:
            return
        logger.info("running shard %s of %s", shard.index, shard.batch_id)
        asyncio.run(_ShardRun(ctx, ctx.engine, shard).run())


class _LeaseLost(Exception):
    pass


class _ShardRun:
    def __init__(self, ctx: WorkerContext, engine: AsyncLLM, shard: ClaimedShard):
        self.ctx = ctx
        self.engine = engine
        self.shard = shard
        self.stop = asyncio.Event()
        self.lease_lost = False
        # Up to an engine's worth of lines each: the engine runs max_num_seqs at once and queues
        # the rest by arrival, so the lines of concurrent shards take turns, and a shard running
        # alone, or the others while one drains its last lines, still fill every seat.
        self.in_flight = asyncio.Semaphore(engine.engine.args.max_num_seqs)

    async def run(self) -> None:
        with self.ctx.session_factory() as session:
            requests = session.scalars(
                select(BatchRequest)
                .where(
                    BatchRequest.batch_id == self.shard.batch_id,
                    BatchRequest.shard_index == self.shard.index,
                    BatchRequest.status == RequestStatus.PENDING,
                )
                .order_by(BatchRequest.line)
            ).all()
        watcher = asyncio.create_task(self._watch())
        try:
            await asyncio.gather(*(self._run_request(r) for r in requests))
        finally:
            watcher.cancel()
        if self.lease_lost:
            logger.warning(
                "lost the lease of shard %s of %s", self.shard.index, self.shard.batch_id
            )
            return
        with transaction(self.ctx.session_factory) as session:
            session.execute(
                update(Shard)
                .where(Shard.id == self.shard.id, Shard.lease_owner == self.ctx.worker_id)
                .values(status=ShardStatus.DONE, lease_owner=None, lease_expires_at=None)
            )
        # Counted after the commit: two shards ending at once must not both miss the other.
        # A batch told to stop is finalized too, even if this shard ended before it noticed:
        # a finalization that ran meanwhile saw this shard running and left it to this one.
        with self.ctx.session_factory() as session:
            remaining = unfinished_shards(session, self.shard.batch_id)
            batch = session.get(Batch, self.shard.batch_id)
            stopped = batch is not None and stopping(batch)
        if remaining == 0 or stopped or self.stop.is_set():
            self.ctx.queue.enqueue("finalize_batch", self.shard.batch_id)

    async def _watch(self) -> None:
        """Renew the lease, and raise the stop flag when the batch is cancelled or expires."""
        renew_every = self.ctx.settings.lease_seconds / 3
        last_renewal = time.monotonic()
        while True:
            await asyncio.sleep(STOP_CHECK_SECONDS)
            with transaction(self.ctx.session_factory) as session:
                batch = session.get(Batch, self.shard.batch_id)
                if batch is None or stopping(batch):
                    self.stop.set()
                if time.monotonic() - last_renewal >= renew_every:
                    renewed = session.execute(
                        update(Shard)
                        .where(Shard.id == self.shard.id, Shard.lease_owner == self.ctx.worker_id)
                        .values(lease_expires_at=time.time() + self.ctx.settings.lease_seconds)
                    )
                    last_renewal = time.monotonic()
                    if renewed.rowcount != 1:
                        self.lease_lost = True
                        self.stop.set()

    async def _run_request(self, request: BatchRequest) -> None:
        async with self.in_flight:
            if self.stop.is_set():
                return  # left pending: finalization marks it cancelled or expired
            try:
                prepared = ENDPOINTS[self.shard.endpoint](request.body, self.engine.engine)
                try:
                    outputs = await self._generate(prepared)
                except ValueError as e:  # the engine's own checks, e.g. the KV cache is too small
                    raise OpenAIError(str(e)) from None
                if outputs is None:
                    return  # stopped mid-way
                body = prepared.response(outputs).model_dump(mode="json")
            except OpenAIError as e:  # what the endpoint would have answered: an error line
                line = openai_error_line(request.custom_id, e).model_dump(mode="json")
                self._record(request, RequestStatus.FAILED, line)
                return
            usage = body.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            self._record(
                request,
                RequestStatus.SUCCEEDED,
                response_line(request.custom_id, 200, body).model_dump(mode="json"),
                prompt_tokens=usage.get("prompt_tokens", 0),
                cached_tokens=cached,
                completion_tokens=usage.get("completion_tokens", 0),
            )

    async def _generate(self, prepared: Prepared) -> list[RequestOutput] | None:
        """Run every engine request of one line; None if the shard was told to stop."""

        async def one(engine_input: Any) -> RequestOutput:
            final = None
            async for output in self.engine.generate(
                engine_input.prompt_token_ids,
                engine_input.params,
                # Unique per attempt: a retried shard may overlap a lost one in this engine.
                request_id=f"{engine_input.request_id}-{uuid.uuid4().hex[:8]}",
                priority=BATCH_PRIORITY,
                final_only=True,
            ):
                final = output
            return final

        work = asyncio.gather(*(one(i) for i in prepared.inputs))
        stop = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            stop.cancel()
            return work.result()
        work.cancel()  # closing the generators aborts the engine requests
        with contextlib.suppress(asyncio.CancelledError):
            await work
        return None

    def _record(self, request: BatchRequest, status: RequestStatus, line: dict, **usage: int):
        with transaction(self.ctx.session_factory) as session:
            written = record_result(session, request, status, line, **usage)
        if written:  # a retried shard's duplicate writes nothing and counts nothing
            outcome = "completed" if status == RequestStatus.SUCCEEDED else "failed"
            BATCH_REQUESTS.labels(outcome).inc()

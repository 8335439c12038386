"""Background responses (`background: true` on `/v1/responses`): the `run_response` task runs one
on this worker's engine, as a shard runs a batch line, and upkeep finds those whose task or run
was lost.

The API saves the response `queued` and queues `run_response(id)`. The task claims it
(store/response_runs.py: in progress, leased to this worker), prepares its request again from
what was stored (its conversation read anew), reserves its worst case against the spend limits,
runs it through the request pipeline as a batch line runs (its input screened, its output
screened once whole) and ends it completed, incomplete or failed, recording its usage and
settling its spend in the transaction that ends it, with its `response.*` webhook event.

Priority: BATCH_PRIORITY, a batch line's. A background response is by definition not interactive
(its client polls, or waits for the webhook), and the engine's priority policy serves the best
priority present as latency-critical, alone in a prefilling step, the rest within a small
token budget. A third, middle priority would make one background response throttle every batch
line whenever no realtime request is present; at the batch lines' priority it takes its turn
among them by arrival (a worker holds at most an engine's worth of any shard's lines at once), and
realtime requests go ahead of it and preempt it as they do batch lines, so they are never starved
by it. Not batch-discounted: OpenAI charges background responses at the standard rate.

Nothing is lost: while it runs, the worker renews the lease and looks at the response every
STOP_CHECK_SECONDS (workers/leases.py). A cancel (`POST /v1/responses/{id}/cancel`) is seen at
the next look and stops it, which aborts its engine requests; a lease that cannot be renewed
stops it, and it is left to another worker. A worker that dies leaves it in progress with a
lease that lapses (or a heartbeat that stops), and upkeep queues it again
(`requeue_lost_responses`); so too a queued response whose task a broker lost. A response claimed
`max_shard_attempts` times fails rather than crash workers for ever. A worker shutting down hands
its responses back at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import asdict, replace
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from pagedbatch.engine.async_llm import EngineDeadError
from pagedbatch.ids import now
from pagedbatch.protocol.errors import OpenAIError, insufficient_quota
from pagedbatch.protocol.pipeline import RequestContext, RequestPipeline, unless
from pagedbatch.protocol.schemas.common import Usage
from pagedbatch.protocol.schemas.responses import ResponseCreateRequest
from pagedbatch.protocol.serving.common import parse_request, worst_case_tokens
from pagedbatch.protocol.serving.responses import (
    PreparedResponse,
    error_code,
    prepare_response,
    previous_response_not_finished,
    previous_response_not_found,
)
from pagedbatch.store.models import UsageRecord
from pagedbatch.store.reservations import Reservation, Settlement, forget_all, settle
from pagedbatch.store.response_runs import (
    Claim,
    claim,
    hand_back,
    held_by,
    look,
    lost_runs,
)
from pagedbatch.store.responses import (
    Conversation,
    ResponseNotFinished,
    ResponseNotFound,
    ResponseRecord,
    conversation,
    finish_response,
    load_response,
)
from pagedbatch.store.retry import is_transient, retrying
from pagedbatch.store.spend import SpendGuard, SpendRefused
from pagedbatch.store.usage import Usage as LedgerUsage
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.heartbeats import dead_workers, trusts_heartbeats
from pagedbatch.workers.leases import Lease
from pagedbatch.workers.webhooks import queue_response_webhooks

logger = logging.getLogger(__name__)

# Background responses one process runs at once: each holds a task thread for as long as it
# runs (embedded: a pool of their own; a worker: Celery threads beyond the shards').
RESPONSE_THREADS = 8
REQUEUE_LIMIT = 1000  # lost responses queued again in one upkeep round

_slots = threading.BoundedSemaphore(RESPONSE_THREADS)


def run_response(ctx: WorkerContext, response_id: str) -> None:
    """Run the background response, if it is still to run and no other worker runs it."""
    if ctx.engine is None:
        raise RuntimeError("run_response needs a worker with an engine")
    with _slots:
        claimed = retrying(
            lambda: claim(
                ctx.session_factory, response_id, ctx.worker_id, ctx.settings.lease_seconds
            ),
            "claiming a background response",
        )
        if claimed is None:
            return  # another worker runs it, or it has ended
        if claimed.attempts > ctx.settings.max_shard_attempts:
            _give_up(ctx, claimed)
            return
        logger.info("running background response %s (attempt %d)", response_id, claimed.attempts)
        asyncio.run(_ResponseRun(ctx, claimed).run())


def requeue_lost_responses(ctx: WorkerContext, queued_before: float | None = None) -> None:
    """Queue again the background responses whose task or run was lost: queued with no task
    queued since `queued_before` (by default `lease_seconds` ago: a broker restart lost it), or
    in progress with no live lease (their worker died). An extra task finds nothing to claim
    and returns."""
    dead = dead_workers(ctx.settings) if trusts_heartbeats(ctx) else None
    if queued_before is None:
        queued_before = time.time() - ctx.settings.lease_seconds
    lost = lost_runs(ctx.session_factory, queued_before, dead, REQUEUE_LIMIT)
    if lost:
        logger.warning("queueing %d background response(s) again: their run was lost", len(lost))
    for response_id in lost:
        ctx.queue.enqueue("run_response", response_id)


def _give_up(ctx: WorkerContext, claimed: Claim) -> None:
    """Fail a response that was claimed more than `max_shard_attempts` times: each run crashed its
    worker or lost its lease."""
    record = retrying(lambda: _load(ctx, claimed.response_id), "reading a background response")
    if record is None:
        return
    error = OpenAIError(
        f"This response was not completed: the work on it was tried {claimed.attempts - 1} "
        "times and failed each time.",
        status_code=500,
        type="server_error",
    )
    _end(ctx, claimed.response_id, _failed_body(record.body, error), None)
    tries = claimed.attempts - 1
    logger.error("background response %s failed %d times: not retrying it", record.id, tries)


def _load(ctx: WorkerContext, response_id: str) -> ResponseRecord | None:
    with ctx.session_factory() as session:
        return load_response(session, ctx.blobs, response_id)


def _failed_body(placeholder: dict[str, Any], error: OpenAIError) -> dict[str, Any]:
    """The Response of a request that failed before it could be prepared."""
    return {
        **placeholder,
        "status": "failed",
        "error": {"code": error_code(error), "message": str(error)},
    }


def _end(
    ctx: WorkerContext,
    response_id: str,
    body: dict[str, Any],
    charge: _Charge | None,
) -> bool:
    """End the response with `body` under this worker's lease, its usage recorded and its spend
    settled in the same transaction (`charge`), and queue its webhooks; False if it had ended
    otherwise or the lease was lost, and then its reservation is released."""

    def then(session: Session) -> None:
        if charge is not None:
            charge.record(session)

    moved = retrying(
        lambda: finish_response(
            ctx.session_factory, ctx.blobs, response_id, body, held_by(ctx.worker_id), then=then
        ),
        "ending a background response",
    )
    if charge is not None:
        charge.close(settled=moved)
    if moved:
        retrying(lambda: queue_response_webhooks(ctx, response_id), "queueing webhooks")
    return moved


class _Charge:
    """A running response's spend: its reservation, and the usage it is recorded with."""

    def __init__(self, ctx: WorkerContext, owner: str, model: str) -> None:
        self.guard = SpendGuard(ctx.session_factory, ctx.settings)
        self.owner = owner
        self.model = model
        self.reservation: Reservation | None = None
        self.used: Usage | None = None

    def reserve(self, prepared: PreparedResponse, max_model_len: int) -> None:
        """Reserve the worst case, at the standard rate; 429 `insufficient_quota` if a budget
        cannot hold it."""
        tokens = worst_case_tokens(prepared, max_model_len)
        try:
            self.reservation = retrying(
                lambda: self.guard.reserve(self.owner, self.model, False, *tokens),
                "reserving a background response's spend",
            )
        except SpendRefused as refused:
            raise insufficient_quota(str(refused)) from None

    def record(self, session: Session) -> None:
        """In the transaction that ends the response: its usage-ledger record, and its
        reservation settled at what that costs."""
        used = self.used
        cost = 0
        if used is not None:
            details = used.prompt_tokens_details
            usage = LedgerUsage(
                owner=self.owner,
                model=self.model,
                input_tokens=used.prompt_tokens,
                output_tokens=used.completion_tokens,
                cached_tokens=details.cached_tokens,
                image_tokens=details.image_tokens or 0,
                audio_tokens=details.audio_tokens or 0,
            )
            session.execute(insert(UsageRecord), [{**asdict(usage), "finished_at": now()}])
            tokens = (usage.input_tokens, usage.cached_tokens, usage.output_tokens)
            cost = self.guard.cost(self.model, False, tokens)
        if self.reservation is not None:
            settle(session, [Settlement(self.reservation, cost)])

    def close(self, settled: bool) -> None:
        """Once the response's end committed (`settled`) or did not: stop renewing the
        reservation, or release it. If the database is away it is left to lapse."""
        reservation, self.reservation = self.reservation, None
        if reservation is None:
            return
        if settled:
            forget_all([Settlement(reservation, 0)])
            return
        try:
            self.guard.release([reservation])
        except Exception:  # noqa: BLE001 - the run is ending either way; upkeep releases it
            logger.warning("could not release a background response's reservation: left to lapse")
            reservation.forget()


class _ResponseRun:
    def __init__(self, ctx: WorkerContext, claimed: Claim) -> None:
        assert ctx.engine is not None
        self.ctx = ctx
        self.engine = ctx.engine
        self.id = claimed.response_id
        self.lease = Lease(
            f"background response {self.id}",
            claimed.leased_until,
            ctx.settings.lease_seconds,
            self._look,
            ctx.stopping,
            renew_after_stop=False,  # a stopped response writes nothing
        )

    async def run(self) -> None:
        record = await asyncio.to_thread(
            retrying, lambda: _load(self.ctx, self.id), "reading a background response"
        )
        if record is None:
            return  # deleted meanwhile
        charge = _Charge(self.ctx, record.owner, self.engine.engine.model_name)
        async with self.lease.kept():
            try:
                body = await self._respond(record, charge)
            except BaseException:
                await asyncio.to_thread(charge.close, False)
                raise
        if body is not None and not self.lease.lost:
            await asyncio.to_thread(_end, self.ctx, self.id, body, charge)
            return
        await asyncio.to_thread(charge.close, False)
        if self.lease.handing_back:
            retrying(
                lambda: hand_back(self.ctx.session_factory, self.id, self.ctx.worker_id),
                "handing a background response back",
            )
            # For another worker; a queue that has stopped takes nothing, and upkeep queues it
            # again.
            retrying(lambda: self.ctx.queue.enqueue("run_response", self.id), "queueing a response")
            logger.info("shutting down: handed background response %s back", self.id)
        elif self.lease.lost:
            logger.warning("lost the lease of background response %s: left to upkeep", self.id)
        else:
            logger.info("background response %s stopped: cancelled or deleted", self.id)

    async def _respond(self, record: ResponseRecord, charge: _Charge) -> dict[str, Any] | None:
        """The Response it ends with (completed, incomplete, or failed with its error); None if
        it was stopped. Its usage is left on `charge`."""
        engine = self.engine.engine
        try:
            prepared = await asyncio.to_thread(self._prepare, record)
        except OpenAIError as error:
            return _failed_body(record.body, error)
        try:
            await asyncio.to_thread(charge.reserve, prepared, engine.max_model_len)
        except OpenAIError as error:
            return prepared.failed(error).model_dump(mode="json")
        context = RequestContext.of(
            self.ctx.settings,
            record.owner,
            door="batch",  # see the module's docstring: BATCH_PRIORITY
            guard=self.ctx.guard,
            moderation=False,
            request_id=record.id,
        )
        pipeline = RequestPipeline(self.engine, prepared, context)
        try:
            answered = await unless(pipeline.batch_line(), self.lease.stop.wait())
        except EngineDeadError:
            raise  # the worker's failure, not the response's: it runs again elsewhere
        except OpenAIError as error:
            return prepared.failed(error).model_dump(mode="json")
        except Exception as error:  # noqa: BLE001 - whatever it is, it is this response's failure
            if is_transient(error):
                raise  # an outage: the lease lapses and another run does it again
            logger.exception("background response %s failed", record.id)
            failure = OpenAIError(
                f"The server failed to answer: {type(error).__name__}.",
                status_code=500,
                type="server_error",
            )
            return prepared.failed(failure).model_dump(mode="json")
        if answered is None:
            return None
        body, charge.used = answered
        return body

    def _prepare(self, record: ResponseRecord) -> PreparedResponse:
        """The stored request prepared again, as the response it is (its id and creation
        time), its conversation read anew; OpenAIError as create would have answered."""
        request = parse_request(ResponseCreateRequest, record.request)
        history = Conversation([], whole=True)
        if record.previous_response_id is not None:
            history = retrying(lambda: self._history(record), "reading a conversation")
        prepared = prepare_response(request, self.engine.engine, history.items, not history.whole)
        prepared.id = prepared.chat.id = record.id
        prepared.created_at = record.created_at
        # Unique per attempt: a run taken over from a lost one may overlap it in this engine.
        attempt = f"{record.id}-{uuid.uuid4().hex[:8]}"
        prepared.inputs = [replace(i, request_id=attempt) for i in prepared.inputs]
        return prepared

    def _history(self, record: ResponseRecord) -> Conversation:
        previous = record.previous_response_id
        assert previous is not None
        settings = self.ctx.settings
        try:
            with self.ctx.session_factory() as session:
                return conversation(
                    session,
                    self.ctx.blobs,
                    record.owner,
                    previous,
                    settings.response_history_max_turns,
                    settings.response_history_max_bytes,
                )
        except ResponseNotFound:  # deleted, or expired, since it was created
            raise previous_response_not_found(previous) from None
        except ResponseNotFinished as running:  # create refused it then: answered as create does
            raise previous_response_not_finished(previous, running.status) from None

    def _look(self, renew: bool) -> tuple[bool, bool]:
        """Whether the response is to stop (cancelled, ended otherwise, or deleted), and whether
        the lease was renewed (only if `renew`)."""
        lease = self.ctx.settings.lease_seconds if renew else None
        seen = look(self.ctx.session_factory, self.id, self.ctx.worker_id, lease)
        return not seen.running, seen.renewed

"""Validating a batch's input file: its format is all or nothing, every problem reported with
its line. A well-formed line that the endpoint would refuse (its prompt past the context, a bad
parameter) fails alone, when this process has the engine to ask: it is *refused* here, before
any engine work, and ends in the error file with the 400 the endpoint answers. A line longer
than a realtime request body may be (`max_request_body_bytes`) fails alone the same way, with the
413 the endpoint answers such a body, whether or not there is an engine: it is neither parsed nor
kept (only its head is read, for its custom_id).

The file is streamed once and its requests are inserted as they are read, committed every
`INSERT_CHUNK` lines so the API's writes never wait on a whole file (SQLite has one writer at a
time). Until the batch moves to `in_progress` they are *staged*: a status that neither shards
nor finalization look at. The move, in one transaction, makes them pending (the refused ones
failed) and creates the shards; a failed, cancelled or abandoned validation deletes them
instead. Rows are inserted skipping any already there, so a validation that is run again (after
a crash, or redriven while the first still runs) builds on what an earlier run left rather than
clashing with it.

A database or S3 outage is ridden out with `pagedbatch.store.retry`; one that outlasts it
leaves the batch `validating`, for upkeep to queue again. Only the file fails a batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from pagedbatch.ids import now
from pagedbatch.protocol.batch_lines import (
    EMBEDDINGS,
    BatchError,
    BatchInputLine,
    BatchOutputLine,
    InputLineChecker,
    InvalidBatchLine,
    LongLine,
    failed_line,
    openai_error_line,
)
from pagedbatch.protocol.schemas.embeddings import MAX_BATCH_EMBEDDING_INPUTS, input_count
from pagedbatch.store.batches import transition
from pagedbatch.store.db import transaction
from pagedbatch.store.models import Batch, BatchRequest, BatchStatus, File, RequestStatus, Shard
from pagedbatch.store.retry import is_transient, retrying
from pagedbatch.workers.batches.endpoints import Endpoint, endpoint
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.webhooks import queue_batch_webhooks

logger = logging.getLogger(__name__)

INSERT_CHUNK = 1000  # lines per write transaction
# Batch.errors is returned by every GET of the batch: a file of garbage reports this many
# problems, each message and param cut to this length (values are echoed in messages), then
# stops being read.
MAX_REPORTED_ERRORS = 100
MAX_ERROR_MESSAGE_CHARS = 500
MAX_ERROR_PARAM_CHARS = 100
# BatchRequest.custom_id's column: a longer one is the line's error, not the database's.
MAX_CUSTOM_ID_CHARS: int = BatchRequest.__table__.c.custom_id.type.length


@dataclass
class _Staged:
    """What reading the file found: its requests were staged unless there are errors."""

    total: int = 0
    model: str | None = None
    inputs: int = 0  # of an /v1/embeddings batch's lines so far
    errors: list[BatchError] = field(default_factory=list)
    abandoned: bool = False  # the batch stopped validating meanwhile (cancelled, or done)


def iter_lines(chunks: Iterable[bytes], max_bytes: int) -> Iterator[bytes | LongLine]:
    """Split a byte stream into lines (without their newline), whatever the chunk boundaries.
    A line of more than `max_bytes` comes as a `LongLine`: memory holds at most `max_bytes` of a
    line, and each byte is copied once, however many chunks a line spans."""
    kept: list[bytes] = []  # the current line's first bytes, up to max_bytes
    held = size = 0  # their count; the line's length so far
    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if held < max_bytes and piece:
                kept.append(piece[: max_bytes - held])
                held += len(kept[-1])
            size += len(piece)
            if end < 0:
                break
            yield _line(kept, size, max_bytes)
            kept, held, size = [], 0, 0
            start = end + 1
    if size:
        yield _line(kept, size, max_bytes)


def _line(kept: list[bytes], size: int, max_bytes: int) -> bytes | LongLine:
    head = b"".join(kept)
    return head if size <= max_bytes else LongLine(head, size)


def validate_batch(ctx: WorkerContext, batch_id: str) -> None:
    try:
        retrying(
            lambda: _validate(ctx, batch_id),
            f"validating batch {batch_id}",
            deadline_seconds=ctx.settings.validation_outage_seconds,
        )
    except Exception as e:
        if is_transient(e):
            logger.warning(
                "validating batch %s: %s outlasted the retries; it stays validating and upkeep "
                "queues it again",
                batch_id,
                type(e).__name__,
            )
            return
        # A bug, not the file: the batch must not sit in `validating` for ever.
        logger.exception("validating batch %s failed", batch_id)
        error = BatchError(
            code="validation_error",
            message=f"The input file could not be "
            f"validated ({type(e).__name__}); the server logged why.",
        )
        _fail(ctx, batch_id, [error])


def _validate(ctx: WorkerContext, batch_id: str) -> None:
    """One whole validation; safe to run again after failing part-way."""
    with ctx.session_factory() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return  # cancelled meanwhile, or a duplicate delivery of this task
        input_file = session.get(File, batch.input_file_id)
    if errors := _file_errors(ctx, input_file):
        _fail(ctx, batch_id, errors)
        return
    staged = _stage_requests(ctx, batch, input_file)
    if staged.errors:
        _fail(ctx, batch_id, staged.errors)
        return
    if staged.abandoned or (num_shards := _start(ctx, batch, staged)) is None:
        _abandon(ctx, batch_id)
        return
    for _ in range(num_shards):
        ctx.queue.enqueue("run_shard")
    if num_shards == 0:  # every line was refused: nothing to run, the files can be written
        ctx.queue.enqueue("finalize_batch", batch_id)


def _start(ctx: WorkerContext, batch: Batch, staged: _Staged) -> int | None:
    """Move the batch to `in_progress` with its staged requests; returns its number of shards,
    or None when it was no longer validating."""
    with transaction(ctx.session_factory) as session:
        # First: the compare-and-set that one validation wins, holding the batch's row.
        if not transition(
            session,
            batch.id,
            BatchStatus.IN_PROGRESS,
            request_total=staged.total,
            model=staged.model,
        ):
            return None
        staged_rows = (
            BatchRequest.batch_id == batch.id,
            BatchRequest.status == RequestStatus.STAGED,
        )
        # Lines refused at validation fail now, counted, and go to no shard.
        refused = session.execute(
            update(BatchRequest)
            .where(BatchRequest.batch_id == batch.id, BatchRequest.status == RequestStatus.REFUSED)
            .values(status=RequestStatus.FAILED.value, finished_at=now())
        ).rowcount
        if refused:
            session.execute(
                update(Batch)
                .where(Batch.id == batch.id)
                .values(request_failed=Batch.request_failed + refused)
            )
        # From the rows, not this run's count: an earlier run under another shard_size may
        # have staged some of them.
        indexes = session.scalars(
            select(BatchRequest.shard_index).distinct().where(*staged_rows)
        ).all()
        session.execute(
            update(BatchRequest).where(*staged_rows).values(status=RequestStatus.PENDING.value)
        )
        if indexes:  # none when every line was refused
            session.execute(
                insert(Shard),
                [{"batch_id": batch.id, "owner": batch.owner, "index": i} for i in indexes],
            )
    return len(indexes)


def _abandon(ctx: WorkerContext, batch_id: str) -> None:
    """The batch stopped validating under us: drop what was staged; a cancelled one is ended
    by finalization (which waits for no validation, and sees no staged request)."""
    _discard_staged(ctx, batch_id)
    with ctx.session_factory() as session:
        status = session.scalar(select(Batch.status).where(Batch.id == batch_id))
    if status != BatchStatus.IN_PROGRESS:  # in progress: another run of ours finished first
        ctx.queue.enqueue("finalize_batch", batch_id)


def _fail(ctx: WorkerContext, batch_id: str, errors: list[BatchError]) -> None:
    report = [_bounded(error) for error in errors[:MAX_REPORTED_ERRORS]]
    with transaction(ctx.session_factory) as session:
        transition(session, batch_id, BatchStatus.FAILED, errors=report)
    queue_batch_webhooks(ctx, batch_id)
    # Only once the batch has left `validating`: another run of ours that started it meanwhile
    # made its staged rows pending first, in the transaction this transition had to wait for.
    _discard_staged(ctx, batch_id)


def _bounded(error: BatchError) -> dict:
    def cut(text: str, limit: int) -> str:
        return text if len(text) <= limit else text[: limit - 1] + "…"

    report = error.model_dump()
    report["message"] = cut(error.message, MAX_ERROR_MESSAGE_CHARS)
    if error.param is not None:
        report["param"] = cut(error.param, MAX_ERROR_PARAM_CHARS)
    return report


def _discard_staged(ctx: WorkerContext, batch_id: str) -> None:
    """Delete the batch's staged (and refused) requests, a chunk per transaction."""
    while True:
        with transaction(ctx.session_factory) as session:
            chunk = (
                select(BatchRequest.id)
                .where(
                    BatchRequest.batch_id == batch_id,
                    BatchRequest.status.in_([RequestStatus.STAGED, RequestStatus.REFUSED]),
                )
                .limit(INSERT_CHUNK)
                .scalar_subquery()
            )
            deleted = session.execute(delete(BatchRequest).where(BatchRequest.id.in_(chunk)))
        if deleted.rowcount < INSERT_CHUNK:
            return


def _file_errors(ctx: WorkerContext, input_file: File | None) -> list[BatchError]:
    if input_file is None or not ctx.blobs.exists(input_file.storage_key):
        return [
            BatchError(
                code="file_not_found",
                message="The input file no longer exists.",
                param="input_file_id",
            )
        ]
    if input_file.bytes > ctx.settings.max_batch_file_bytes:
        limit = ctx.settings.max_batch_file_bytes
        return [
            BatchError(
                code="file_too_large",
                message=f"The input file has {input_file.bytes} bytes; the limit is {limit}.",
                param="input_file_id",
            )
        ]
    return []


def _stage_requests(ctx: WorkerContext, batch: Batch, input_file: File) -> _Staged:
    """Check every line; stage the requests while none is bad."""
    checker = InputLineChecker([batch.endpoint])
    served = endpoint(ctx, batch.endpoint)  # None: no engine here to check models and bodies
    limit = ctx.settings.max_batch_lines
    # A line is held to a realtime request body's bound: past it, it is refused unread.
    max_line = ctx.settings.max_request_body_bytes
    staged = _Staged()
    rows: list[dict] = []
    lines = iter_lines(ctx.blobs.open(input_file.storage_key), max_line)
    for number, raw in enumerate(lines, start=1):
        if isinstance(raw, bytes) and not raw.strip():
            continue
        staged.total += 1
        if staged.total > limit:
            staged.errors.append(
                BatchError(
                    code="too_many_lines",
                    line=number,
                    message=f"A batch holds at most {limit} requests.",
                )
            )
            break
        try:
            if isinstance(raw, LongLine):
                custom_id, refusal = checker.check_long(raw, number, max_line)
                _check_custom_id(custom_id, number)
                # Its body is not kept: its result is the refusal.
                body: dict[str, Any] = {}
                status = _refused(openai_error_line(custom_id, refusal))
            else:
                line = _check_line(checker, raw, number, staged.model, served)
                custom_id, body = line.custom_id, line.body
                staged.model = line.body["model"]
                status = _staged_status(served, line)
        except InvalidBatchLine as e:
            staged.errors.append(e.error)
            if len(staged.errors) >= MAX_REPORTED_ERRORS:
                break
            continue
        if batch.endpoint == EMBEDDINGS and body:
            staged.inputs += input_count(body.get("input"))
            if staged.inputs > MAX_BATCH_EMBEDDING_INPUTS:
                staged.errors.append(
                    BatchError(
                        code="too_many_inputs",
                        line=number,
                        param="body.input",
                        message=f"An /v1/embeddings batch holds at most "
                        f"{MAX_BATCH_EMBEDDING_INPUTS} inputs across its lines.",
                    )
                )
                break
        if staged.errors:
            continue  # the batch will fail; keep checking, stop storing
        rows.append(
            {
                "batch_id": batch.id,
                "line": number,
                "custom_id": custom_id,
                "shard_index": (staged.total - 1) // ctx.settings.shard_size,
                "body": body,
                **status,
            }
        )
        if len(rows) >= INSERT_CHUNK:
            if not _insert_chunk(ctx, batch.id, rows):
                staged.abandoned = True
                return staged
            rows.clear()
    if staged.total == 0 and not staged.errors:
        staged.errors.append(
            BatchError(code="empty_file", message="The input file has no requests.")
        )
    if rows and not staged.errors and not _insert_chunk(ctx, batch.id, rows):
        staged.abandoned = True
    return staged


def _check_line(
    checker: InputLineChecker,
    raw: bytes,
    number: int,
    model: str | None,
    served: Endpoint | None,
) -> BatchInputLine:
    """The line's request, or `InvalidBatchLine`; whatever goes wrong is this line's error."""
    try:
        line = checker.check(raw, number)
        _check_custom_id(line.custom_id, number)
        _check_model(line.body, model, served, number)
        return line
    except InvalidBatchLine:
        raise
    except Exception as e:  # noqa: BLE001 - a checker's bug must not crash the batch's validation
        logger.exception("checking line %d raised", number)
        raise InvalidBatchLine(
            "invalid_request",
            f"The line could not be checked ({type(e).__name__}); the server logged why.",
            line=number,
        ) from None


def _check_custom_id(custom_id: str, number: int) -> None:
    """What the database can store of a custom_id: no NUL, and no more than its column holds."""
    if "\x00" in custom_id:
        raise InvalidBatchLine(
            "invalid_value",
            "custom_id must not contain NUL.",
            line=number,
            param="custom_id",
        )
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise InvalidBatchLine(
            "invalid_value",
            f"custom_id has {len(custom_id)} characters; "
            f"at most {MAX_CUSTOM_ID_CHARS} are allowed.",
            line=number,
            param="custom_id",
        )


def _refused(error: BatchOutputLine) -> dict[str, Any]:
    return {"status": RequestStatus.REFUSED, "result": error.model_dump(mode="json")}


def _staged_status(served: Endpoint | None, line: BatchInputLine) -> dict[str, Any]:
    """STAGED, or REFUSED with the error line the endpoint answers this line with (a prompt past
    the context, a bad parameter, an image it cannot read), found by preparing the line as its
    shard would. Without an engine in this process to ask, STAGED: the shard refuses such a line
    the same way. A refused line fails alone; its batch goes on without it."""
    if served is not None:
        try:
            served.prepare(line.body, served.engine.engine)
        except Exception as e:  # noqa: BLE001 - whatever it is, it is this line's failure
            return _refused(failed_line(line.custom_id, e))
    return {"status": RequestStatus.STAGED, "result": None}


def _insert_chunk(ctx: WorkerContext, batch_id: str, rows: list[dict]) -> bool:
    """Stage `rows` in a transaction of their own, skipping any already staged; False when the
    batch is no longer validating (then nothing more should be staged)."""
    with transaction(ctx.session_factory) as session:
        session.execute(_insert_skipping_existing(session), rows)
        status = session.scalar(select(Batch.status).where(Batch.id == batch_id))
    return status == BatchStatus.VALIDATING


def _insert_skipping_existing(session: Session) -> postgresql.Insert | sqlite.Insert:
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    return dialect.insert(BatchRequest).on_conflict_do_nothing(
        index_elements=["batch_id", "custom_id"]
    )


def _check_model(body: dict, model: str | None, served: Endpoint | None, line: int) -> None:
    requested = body.get("model")
    if not isinstance(requested, str) or not requested:
        raise InvalidBatchLine(
            "missing_required_parameter",
            "Missing required parameter: 'body.model'.",
            line=line,
            param="body.model",
        )
    if model is not None and requested != model:
        raise InvalidBatchLine(
            "mismatched_model",
            f"Every line must use the same model: line "
            f"{line} asks for {requested!r}, earlier lines for {model!r}.",
            line=line,
            param="body.model",
        )
    if served is not None and not served.serves(requested):
        raise InvalidBatchLine(
            "model_not_found",
            f"The model {requested!r} is not served here; this service serves {served.model!r}.",
            line=line,
            param="body.model",
        )

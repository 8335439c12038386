"""Validating a batch's input file: all or nothing, every problem reported with its line.

The file is streamed once. Its requests are inserted as they are read, inside one transaction
that is rolled back if any line is bad, so a failed batch leaves no rows and a valid one is split
into shards atomically with its move to `in_progress`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from sqlalchemy import insert
from sqlalchemy.orm import Session

from pagedbatch.api.schemas.batch_lines import BatchError, InputLineChecker, InvalidBatchLine
from pagedbatch.store.batches import transition
from pagedbatch.store.db import transaction
from pagedbatch.store.models import Batch, BatchRequest, BatchStatus, File, Shard
from pagedbatch.workers.context import WorkerContext
from pagedbatch.workers.webhooks import queue_batch_webhooks

logger = logging.getLogger(__name__)

INSERT_CHUNK = 1000
MAX_REPORTED_ERRORS = 1000  # a 50,000-line file of garbage reports this many, then stops reading


class _Invalid(Exception):
    def __init__(self, errors: list[BatchError]):
        self.errors = errors


class _Cancelled(Exception):
    pass


def iter_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Split a byte stream into lines (without their newline), whatever the chunk boundaries."""
    tail = b""
    for chunk in chunks:
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        yield from lines
    if tail:
        yield tail


def validate_batch(ctx: WorkerContext, batch_id: str) -> None:
    with ctx.session_factory() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return  # cancelled meanwhile, or a duplicate delivery of this task
        input_file = session.get(File, batch.input_file_id)
    try:
        if errors := _file_errors(ctx, input_file):
            raise _Invalid(errors)
        with transaction(ctx.session_factory) as session:
            total, model, errors = _load_requests(ctx, session, batch, input_file)
            if errors:
                raise _Invalid(errors)  # rolls back the rows read so far
            num_shards = -(-total // ctx.settings.shard_size)
            shards = [
                {"batch_id": batch_id, "owner": batch.owner, "index": i} for i in range(num_shards)
            ]
            session.execute(insert(Shard), shards)
            if not transition(
                session, batch_id, BatchStatus.IN_PROGRESS, request_total=total, model=model
            ):
                raise _Cancelled
    except _Invalid as e:
        report = [error.model_dump() for error in e.errors[:MAX_REPORTED_ERRORS]]
        with transaction(ctx.session_factory) as session:
            transition(session, batch_id, BatchStatus.FAILED, errors=report)
        queue_batch_webhooks(ctx, batch_id)
        return
    except _Cancelled:
        ctx.queue.enqueue("finalize_batch", batch_id)
        return
    except Exception as e:
        # Whatever went wrong, a batch must not sit in `validating` for ever.
        logger.exception("validating batch %s failed", batch_id)
        error = BatchError(
            code="validation_error",
            message=f"The input file could not be "
            f"validated ({type(e).__name__}); the server logged why.",
        )
        with transaction(ctx.session_factory) as session:
            transition(session, batch_id, BatchStatus.FAILED, errors=[error.model_dump()])
        queue_batch_webhooks(ctx, batch_id)
        return
    for _ in range(num_shards):
        ctx.queue.enqueue("run_shard")


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


def _load_requests(
    ctx: WorkerContext, session: Session, batch: Batch, input_file: File
) -> tuple[int, str | None, list[BatchError]]:
    """Insert the file's requests; returns (count, model, errors)."""
    checker = InputLineChecker([batch.endpoint])
    served = ctx.served_model
    limit = ctx.settings.max_batch_lines
    errors: list[BatchError] = []
    rows: list[dict] = []
    model: str | None = None
    count = 0
    for number, raw in enumerate(iter_lines(ctx.blobs.open(input_file.storage_key)), start=1):
        if not raw.strip():
            continue
        count += 1
        if count > limit:
            errors.append(
                BatchError(
                    code="too_many_lines",
                    line=number,
                    message=f"A batch holds at most {limit} requests.",
                )
            )
            break
        try:
            line = checker.check(raw, number)
            if "\x00" in line.custom_id:  # no database stores NUL in text
                raise InvalidBatchLine(
                    "invalid_value",
                    "custom_id must not contain NUL.",
                    line=number,
                    param="custom_id",
                )
            model = _check_model(line.body, model, served, number)
        except InvalidBatchLine as e:
            errors.append(e.error)
            if len(errors) >= MAX_REPORTED_ERRORS:
                break
            continue
        if errors:
            continue  # the batch will fail; keep checking, stop storing
        rows.append(
            {
                "batch_id": batch.id,
                "line": number,
                "custom_id": line.custom_id,
                "shard_index": (count - 1) // ctx.settings.shard_size,
                "body": line.body,
            }
        )
        if len(rows) >= INSERT_CHUNK:
            session.execute(insert(BatchRequest), rows)
            rows.clear()
    if count == 0 and not errors:
        errors.append(BatchError(code="empty_file", message="The input file has no requests."))
    if rows and not errors:
        session.execute(insert(BatchRequest), rows)
    return count, model, errors


def _check_model(body: dict, model: str | None, served: str | None, line: int) -> str:
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
    if served is not None and requested != served:
        raise InvalidBatchLine(
            "model_not_found",
            f"The model {requested!r} is not served here; this service serves {served!r}.",
            line=line,
            param="body.model",
        )
    return requested

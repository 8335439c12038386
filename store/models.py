"""The job store's tables. Times are Unix seconds (ints), as OpenAI's objects carry them.

`owner` is the tenant: the id of the API key that created the row, or "default" without auth.
"""

from __future__ import annotations

import enum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from pagedbatch.ids import now

DEFAULT_OWNER = "default"


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TERMINAL = {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}


class ShardStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"


class RequestStatus(enum.StrEnum):
    STAGED = "staged"  # written by a validation still running: no shard or finalization reads it
    REFUSED = "refused"  # staged, with the error line the endpoint answers it with (its result)
    PENDING = "pending"
    SUCCEEDED = "succeeded"  # a line in the output file
    FAILED = "failed"  # a line in the error file: the endpoint refused it
    EXPIRED = "expired"  # error file, batch_expired
    CANCELLED = "cancelled"  # error file, batch_cancelled


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex; keys never stored
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class File(Base):
    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now, index=True)
    expires_at: Mapped[int | None] = mapped_column(BigInteger, index=True)
    status: Mapped[str] = mapped_column(String(16), default="processed")
    storage_key: Mapped[str] = mapped_column(String(256))


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True)
    model: Mapped[str | None] = mapped_column(String(256))
    errors: Mapped[list[Any] | None]  # BatchError dicts when validation failed
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata")
    output_expires_after_seconds: Mapped[int | None] = mapped_column(BigInteger)

    created_at: Mapped[int] = mapped_column(BigInteger, default=now, index=True)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger)
    completed_at: Mapped[int | None] = mapped_column(BigInteger)
    failed_at: Mapped[int | None] = mapped_column(BigInteger)
    expired_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger)
    # Held by the process writing the result files; a stale claim is taken over.
    finalize_claimed_at: Mapped[int | None] = mapped_column(BigInteger)

    request_total: Mapped[int] = mapped_column(default=0)
    request_completed: Mapped[int] = mapped_column(default=0)
    request_failed: Mapped[int] = mapped_column(default=0)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class Shard(Base):
    """A slice of a batch's requests: the unit a worker leases and runs."""

    __tablename__ = "shards"
    __table_args__ = (UniqueConstraint("batch_id", "index"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), index=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)  # copied for fair claiming
    index: Mapped[int]
    status: Mapped[str] = mapped_column(String(16), default=ShardStatus.PENDING, index=True)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(default=0)


class BatchRequest(Base):
    """One input line, and once it ran, its output line."""

    __tablename__ = "batch_requests"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id"),
        Index("ix_batch_requests_shard", "batch_id", "shard_index", "status"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    line: Mapped[int]  # 1-based line of the input file
    custom_id: Mapped[str] = mapped_column(String(512))
    shard_index: Mapped[int]
    body: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default=RequestStatus.PENDING)
    result: Mapped[dict[str, Any] | None]  # the whole output or error line
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    cached_tokens: Mapped[int] = mapped_column(default=0)
    completion_tokens: Mapped[int] = mapped_column(default=0)
    finished_at: Mapped[int | None] = mapped_column(BigInteger)


class UsageRecord(Base):
    """One finished request's tokens, realtime or a batch line: the ledger that usage and costs
    are read from (store/usage.py). Apart from batch requests, whose retention is shorter; a
    batch line's record is written in the transaction that records its result, once."""

    __tablename__ = "usage_records"
    __table_args__ = (Index("ix_usage_records_time", "finished_at"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(64))  # the tenant: its API key's id
    model: Mapped[str] = mapped_column(String(256))
    batch_id: Mapped[str | None] = mapped_column(String(64))  # None: a realtime request
    # Which of OpenAI's usage endpoints counts it: "completions" or "embeddings" (store/usage.py).
    kind: Mapped[str] = mapped_column(
        String(16), default="completions", server_default="completions"
    )
    input_tokens: Mapped[int] = mapped_column(default=0)  # cached, image and audio ones included
    cached_tokens: Mapped[int] = mapped_column(default=0)
    output_tokens: Mapped[int] = mapped_column(default=0)
    image_tokens: Mapped[int] = mapped_column(default=0)
    audio_tokens: Mapped[int] = mapped_column(default=0)
    finished_at: Mapped[int] = mapped_column(BigInteger)  # Unix seconds


class SpendLimit(Base):
    """The service's hard spend limit (`/v1/organization/spend_limit`): one row, or none."""

    __tablename__ = "spend_limits"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # ORGANIZATION
    threshold_cents: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String(8))
    interval: Mapped[str] = mapped_column(String(16))
    notification_channel: Mapped[dict[str, Any] | None]
    updated_at: Mapped[int] = mapped_column(BigInteger, default=now)


class SpendBudget(Base):
    """One budget's month (store/reservations.py): the service's, or one API key's. Requests reserve
    their worst case here before they run and settle to their actual cost when they end; a
    reservation is taken only if spent + reserved stays within the limit."""

    __tablename__ = "spend_budgets"

    scope: Mapped[str] = mapped_column(String(80), primary_key=True)  # ORGANIZATION or key:<id>
    month: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # when its UTC month began
    spent_nanos: Mapped[int] = mapped_column(BigInteger, default=0)  # settled, in nano-dollars
    reserved_nanos: Mapped[int] = mapped_column(BigInteger, default=0)  # held by running requests


class SpendReservation(Base):
    """What one running request (or batch line) may still spend, held in its key's and the
    service's budgets of `month`. Its holder renews `expires_at` while it runs; upkeep releases
    one that lapsed (its holder died)."""

    __tablename__ = "spend_reservations"
    __table_args__ = (Index("ix_spend_reservations_expiry", "expires_at"),)

    # SQLite numbers only an INTEGER primary key by itself.
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    owner: Mapped[str] = mapped_column(String(64))
    month: Mapped[int] = mapped_column(BigInteger)
    nanos: Mapped[int] = mapped_column(BigInteger)
    holder: Mapped[str] = mapped_column(String(128))  # the process that holds it, for the logs
    expires_at: Mapped[float] = mapped_column(Float)  # Unix seconds


class IdempotencyKey(Base):
    """The resource a POST created under an `Idempotency-Key`, returned again on a retry."""

    __tablename__ = "idempotency_keys"

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)
    route: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(256), primary_key=True)
    resource_id: Mapped[str] = mapped_column(String(64))
    # sha256 hex of what the request said (api/idempotency.py); None for keys stored before.
    fingerprint: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class WebhookEndpoint(Base):
    """A URL of a tenant's that hears of its batches' ends, signed with the endpoint's secret."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    events: Mapped[list[Any] | None]  # the event types sent; None: all of them
    secret: Mapped[str] = mapped_column(String(128))  # `whsec_` + base64; needed to sign
    # The secret before the last rotation signs too until it expires, so a receiver can switch
    # to the new one without rejecting a delivery.
    previous_secret: Mapped[str | None] = mapped_column(String(128))
    previous_secret_expires_at: Mapped[int | None] = mapped_column(BigInteger)
    disabled_at: Mapped[int | None] = mapped_column(BigInteger)  # set when a receiver said 410
    disabled_reason: Mapped[str | None] = mapped_column(String(512))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now, index=True)


class ResponseStatus(enum.StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    CANCELLED = "cancelled"


RESPONSE_TERMINAL = {
    ResponseStatus.COMPLETED,
    ResponseStatus.INCOMPLETE,
    ResponseStatus.FAILED,
    ResponseStatus.CANCELLED,
}


class StoredResponse(Base):
    """A response of `/v1/responses` created with `store` (store/responses.py): what retrieve,
    input_items and `previous_response_id` read, until `expires_at`. Its three documents (the
    request less its input, the input items, the Response object) are JSON columns, or, when
    one is large, a blob whose key `blob_keys` holds under the document's name."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # resp_...
    owner: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    model: Mapped[str] = mapped_column(String(256))
    background: Mapped[bool] = mapped_column(Boolean, default=False)
    # Not a foreign key: the earlier response may be deleted or expire first.
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    request: Mapped[dict[str, Any] | None]  # the create request less its input
    input_items: Mapped[list[Any] | None]
    response: Mapped[dict[str, Any] | None]  # the Response object, as GET answers it
    blob_keys: Mapped[dict[str, Any] | None]  # document name -> its blob's key
    error: Mapped[dict[str, Any] | None]  # the Response's error, where it failed
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    completed_at: Mapped[int | None] = mapped_column(BigInteger)  # when it reached its end
    expires_at: Mapped[int | None] = mapped_column(BigInteger, index=True)  # None: kept for good
    # A background response's run (workers/responses.py): the lease of the worker running it
    # (renewed while it runs; lapsed, another worker takes it over), how many times it was
    # claimed, and when its task was last queued (time.time()).
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    queued_at: Mapped[float | None] = mapped_column(Float)


class WebhookEvent(Base):
    """Something that happened to a batch or a background response, recorded in the transaction
    that made it happen: exactly one of `batch_id` and `response_id` is set."""

    __tablename__ = "webhook_events"
    __table_args__ = (
        CheckConstraint("(batch_id IS NULL) <> (response_id IS NULL)", name="one_subject"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # evt_...
    owner: Mapped[str] = mapped_column(String(64), index=True)
    type: Mapped[str] = mapped_column(String(32))  # batch.completed, response.completed, ...
    # A batch or a response ends once, so it has one event.
    batch_id: Mapped[str | None] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), unique=True
    )
    response_id: Mapped[str | None] = mapped_column(
        ForeignKey("responses.id", ondelete="CASCADE"), unique=True
    )
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class WebhookMessageStatus(enum.StrEnum):
    PENDING = "pending"  # waiting for its next attempt, or in one
    DELIVERED = "delivered"
    FAILED = "failed"  # out of attempts, or its endpoint was disabled


class WebhookMessage(Base):
    """One event on its way to one endpoint. Its id is the `webhook-id` of every attempt, which
    receivers use to drop duplicates."""

    __tablename__ = "webhook_messages"
    __table_args__ = (
        UniqueConstraint("event_id", "endpoint_id"),
        Index("ix_webhook_messages_due", "status", "next_attempt_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # wh_...
    event_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_events.id", ondelete="CASCADE"), index=True
    )
    endpoint_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True
    )
    status: Mapped[str] = mapped_column(String(16), default=WebhookMessageStatus.PENDING)
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[float] = mapped_column(Float)  # Unix seconds
    # Set while an attempt runs; a claim that lapsed belonged to a process that died.
    claimed_until: Mapped[float | None] = mapped_column(Float)


class WebhookOutcome(enum.StrEnum):
    DELIVERED = "delivered"  # the receiver answered 2xx
    FAILED = "failed"  # anything else but 410; retried while attempts remain
    DISABLED = "disabled"  # the receiver answered 410 Gone: its endpoint is disabled


class WebhookDelivery(Base):
    """One attempt to deliver a message: the delivery log an endpoint's owner can read."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_endpoint", "endpoint_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # whd_...
    message_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_messages.id", ondelete="CASCADE"), index=True
    )
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    attempt: Mapped[int]  # 1 for the first
    outcome: Mapped[str] = mapped_column(String(16))
    status_code: Mapped[int | None]
    latency_ms: Mapped[int | None]  # until the response's headers, or the failure
    error: Mapped[str | None] = mapped_column(String(1024))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class WorkerHeartbeat(Base):
    """A process that runs tasks, alive while `last_seen` is recent (workers/heartbeats.py)."""

    __tablename__ = "worker_heartbeats"

    worker_id: Mapped[str] = mapped_column(String(128), primary_key=True)  # a shard's lease_owner
    last_seen: Mapped[float] = mapped_column(Float, index=True)  # Unix seconds

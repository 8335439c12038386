"""Batch objects and the body of `POST /v1/batches`, as OpenAI defines them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedbatch.api.files.schemas import ExpiresAfter
from pagedbatch.store.models import Batch

# `/v1/moderations` where a moderation model is configured; `/v1/embeddings` where an embedding
# model is, or the main model is one.
SUPPORTED_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/moderations",
    "/v1/responses",
)


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    # Checked by the route, whose message lists the choices; the enum documents them.
    endpoint: str = Field(json_schema_extra={"enum": list(SUPPORTED_ENDPOINTS)})
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None

    @field_validator("input_file_id")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        # PostgreSQL text cannot hold NUL: looking such an id up would fail, not find nothing.
        if "\x00" in value:
            raise ValueError("it contains a NUL character")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > 16:
            raise ValueError("metadata holds at most 16 pairs")
        for key, item in value.items():
            if len(key) > 64:
                raise ValueError(f"metadata key {key[:20]!r}... is longer than 64 characters")
            if len(item) > 512:
                raise ValueError(f"metadata value of {key!r} is longer than 512 characters")
        return value


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchErrorData(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorData]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
    ]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None

    @classmethod
    def from_row(cls, batch: Batch) -> BatchObject:
        total_in, total_out = batch.input_tokens, batch.output_tokens
        return cls(
            id=batch.id,
            endpoint=batch.endpoint,
            model=batch.model,
            errors=BatchErrors(data=batch.errors) if batch.errors else None,
            input_file_id=batch.input_file_id,
            completion_window=batch.completion_window,
            status=batch.status,
            output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            created_at=batch.created_at,
            in_progress_at=batch.in_progress_at,
            expires_at=batch.expires_at,
            finalizing_at=batch.finalizing_at,
            completed_at=batch.completed_at,
            failed_at=batch.failed_at,
            expired_at=batch.expired_at,
            cancelling_at=batch.cancelling_at,
            cancelled_at=batch.cancelled_at,
            request_counts=BatchRequestCounts(
                total=batch.request_total,
                completed=batch.request_completed,
                failed=batch.request_failed,
            ),
            usage=BatchUsage(
                input_tokens=total_in,
                input_tokens_details=InputTokensDetails(cached_tokens=batch.cached_tokens),
                output_tokens=total_out,
                output_tokens_details=OutputTokensDetails(),
                total_tokens=total_in + total_out,
            ),
            metadata=batch.metadata_,
        )

"""The Files API's objects and upload parameters, as OpenAI defines them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# What a client may upload; the service itself also stores `batch_output` files.
UploadPurpose = Literal["assistants", "batch", "fine-tune", "vision", "user_data", "evals"]

MIN_EXPIRY_SECONDS = 3600
MAX_EXPIRY_SECONDS = 30 * 24 * 3600


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_EXPIRY_SECONDS, le=MAX_EXPIRY_SECONDS)


class FileCreateParams(BaseModel):
    """The upload's form fields other than `file`; `expires_after[seconds]` arrives nested."""

    model_config = ConfigDict(extra="forbid")

    purpose: UploadPurpose
    expires_after: ExpiresAfter | None = None


class FileObject(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    # Deprecated by OpenAI but still required by its schema: always sent.
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True

"""The admin API's usage and costs objects, in OpenAI's shapes: a page of time buckets, each
holding one result per group."""

from __future__ import annotations

from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

Result = TypeVar("Result", bound=BaseModel)


class CompletionsUsageResult(BaseModel):
    object: Literal["organization.usage.completions.result"] = (
        "organization.usage.completions.result"
    )
    input_tokens: int  # cached, image and audio tokens included, as OpenAI counts them
    output_tokens: int
    input_cached_tokens: int
    input_image_tokens: int
    input_audio_tokens: int
    num_model_requests: int
    project_id: str | None = None
    user_id: str | None = None
    api_key_id: str | None = None  # set when grouped by it, as the others below
    model: str | None = None
    batch: bool | None = None
    service_tier: str | None = None


class EmbeddingsUsageResult(BaseModel):
    object: Literal["organization.usage.embeddings.result"] = "organization.usage.embeddings.result"
    input_tokens: int
    num_model_requests: int
    project_id: str | None = None
    user_id: str | None = None
    api_key_id: str | None = None  # set when grouped by it, as model
    model: str | None = None


class Amount(BaseModel):
    value: float
    currency: Literal["usd"] = "usd"


class CostResult(BaseModel):
    object: Literal["organization.costs.result"] = "organization.costs.result"
    amount: Amount
    line_item: str | None = None  # set when grouped by it, as api_key_id
    api_key_id: str | None = None
    quantity: int | None = None  # the line item's tokens
    quantity_unit: Literal["tokens"] | None = None
    project_id: str | None = None


class Bucket(BaseModel, Generic[Result]):
    object: Literal["bucket"] = "bucket"
    start_time: int
    end_time: int
    results: list[Result]


class Page(BaseModel, Generic[Result]):
    object: Literal["page"] = "page"
    data: list[Bucket[Result]]
    has_more: bool
    next_page: str | None


UsagePage = Page[CompletionsUsageResult]
EmbeddingsUsagePage = Page[EmbeddingsUsageResult]
CostsPage = Page[CostResult]


class NotificationChannel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["email"]
    recipients: Annotated[list[Annotated[str, Field(max_length=320)]], Field(max_length=50)] = []
    subject_prefix: Annotated[str, Field(max_length=100)] | None = None


class SpendLimitUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    currency: Literal["USD"]
    interval: Literal["month"]
    threshold_amount: Annotated[int, Field(ge=0, le=2**53)]  # cents
    notification_channel: NotificationChannel | None = None  # kept, not sent: we send no mail


class Enforcement(BaseModel):
    status: Literal["inactive", "enforcing"]


class SpendLimitObject(BaseModel):
    object: Literal["organization.spend_limit"] = "organization.spend_limit"
    currency: str
    interval: str
    threshold_amount: int
    enforcement: Enforcement
    notification_channel: dict | None = None


class SpendLimitDeleted(BaseModel):
    object: Literal["organization.spend_limit.deleted"] = "organization.spend_limit.deleted"
    deleted: bool

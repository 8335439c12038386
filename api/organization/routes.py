"""The admin API: usage and costs, read from the usage ledger (store/usage.py), and the service's
spend limit (store/spend.py).

An admin key (`PAGEDBATCH_ADMIN_KEYS`; the SDK's `admin_api_key`) reads every tenant's usage; a
tenant's own key reads its own through the same endpoints, never another's. Only admin keys
read or set the spend limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Depends, Request
from pydantic import BaseModel
from sqlalchemy import delete

from pagedbatch.api.auth import UsageScopeDep, require_admin
from pagedbatch.api.deps import ServicesDep, SessionDep
from pagedbatch.api.organization.schemas import (
    Amount,
    CompletionsUsageResult,
    CostResult,
    CostsPage,
    EmbeddingsUsagePage,
    EmbeddingsUsageResult,
    SpendLimitDeleted,
    SpendLimitObject,
    SpendLimitUpdate,
    UsagePage,
)
from pagedbatch.api.routes.openapi import error_responses, json_body
from pagedbatch.ids import now
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.serving.common import parse_request
from pagedbatch.store.models import SpendLimit
from pagedbatch.store.reservations import ORGANIZATION
from pagedbatch.store.spend import SpendGuard
from pagedbatch.store.usage import COMPLETIONS, EMBEDDINGS, UsageQuery, UsageSums, usage_sums

router = APIRouter(prefix="/organization", tags=["organization"])
Page = TypeVar("Page", UsagePage, EmbeddingsUsagePage, CostsPage)

# Bucket width: (seconds, buckets a page holds by default, at most), as OpenAI has them.
WIDTHS = {"1m": (60, 60, 1440), "1h": (3600, 24, 168), "1d": (86400, 7, 31)}
COST_WIDTHS = {"1d": (86400, 7, 180)}
GROUPS = ("model", "batch", "api_key_id")
EMBEDDING_GROUPS = ("model", "api_key_id")  # OpenAI's embeddings usage has no batch field
COST_GROUPS = ("line_item", "api_key_id")
MAX_FILTER_VALUES = 100


@dataclass(frozen=True)
class _Window:
    """The buckets one page covers: from `first` (a bucket's start) to `stop`, within the
    query's [start, end)."""

    start: int
    end: int
    width: int
    first: int
    stop: int

    def records(self, **selection: Any) -> UsageQuery:
        """The query of the records this page's buckets hold, selected as `selection` says."""
        return UsageQuery(
            start=max(self.start, self.first), end=self.stop, width=self.width, **selection
        )

    def page(self, page: type[Page], results: dict[int, list[BaseModel]]) -> Page:
        """The page of every bucket it covers, each with its `results` (none by default)."""
        more = self.stop < self.end
        return page(
            data=[
                {
                    "start_time": max(at, self.start),
                    "end_time": min(at + self.width, self.end),
                    "results": results.get(at, []),
                }
                for at in range(self.first, self.stop, self.width)
            ],
            has_more=more,
            next_page=str(self.stop) if more else None,
        )


def _window(params: _Params, widths: dict[str, tuple[int, int, int]]) -> _Window:
    width, default_limit, most = widths[params.choice("bucket_width", widths, "1d")]
    start = params.integer("start_time", required=True)
    end = params.integer("end_time") or now() + 1
    if end <= start:
        raise OpenAIError("end_time must be after start_time.", param="end_time")
    limit = params.integer("limit") or default_limit
    if not 1 <= limit <= most:
        raise OpenAIError(
            f"limit must be between 1 and {most} for this bucket width.", param="limit"
        )
    aligned = start - start % width  # the first bucket's start
    first = params.integer("page") or aligned
    if first % width or first < aligned:
        raise OpenAIError("page is not a cursor this query gave.", param="page")
    return _Window(start, end, width, first, min(end, first + limit * width))


def _owners(params: _Params, scope: str | None) -> frozenset[str] | None:
    """Whose records to read: the keys asked for, and never another tenant's for a tenant."""
    keys = params.values("api_key_ids")
    owners = frozenset(keys) if keys else None
    if scope is not None:
        owners = frozenset({scope}) & owners if owners is not None else frozenset({scope})
    return owners


def _group_by(params: _Params, allowed: tuple[str, ...]) -> frozenset[str]:
    group_by = params.values("group_by")
    if unknown := set(group_by) - set(allowed):
        raise OpenAIError(
            f"group_by: {sorted(unknown)[0]!r} is not supported; use {', '.join(allowed)}.",
            param="group_by",
        )
    return frozenset(group_by)


@router.get(
    "/usage/completions",
    response_model=UsagePage,
    responses=error_responses(400, 401),
)
def completions_usage(request: Request, scope: UsageScopeDep, session: SessionDep) -> UsagePage:
    """Tokens and requests of the models that generate (chat, completions, responses,
    transcriptions), realtime and batch, in time buckets."""
    params = _Params(request)
    window = _window(params, WIDTHS)
    query = window.records(
        group_by=_group_by(params, GROUPS),
        owners=_owners(params, scope),
        models=frozenset(models) if (models := params.values("models")) else None,
        batch=params.boolean("batch"),
        kind=COMPLETIONS,
    )
    by_bucket: dict[int, list[CompletionsUsageResult]] = {}
    for sums in usage_sums(session, query):
        by_bucket.setdefault(sums.bucket, []).append(_result(sums))
    return window.page(UsagePage, by_bucket)


@router.get(
    "/usage/embeddings",
    response_model=EmbeddingsUsagePage,
    responses=error_responses(400, 401),
)
def embeddings_usage(
    request: Request, scope: UsageScopeDep, session: SessionDep
) -> EmbeddingsUsagePage:
    """Input tokens and requests of embeddings, realtime and batch together, in time buckets."""
    params = _Params(request)
    window = _window(params, WIDTHS)
    query = window.records(
        group_by=_group_by(params, EMBEDDING_GROUPS),
        owners=_owners(params, scope),
        models=frozenset(models) if (models := params.values("models")) else None,
        kind=EMBEDDINGS,
    )
    by_bucket: dict[int, list[EmbeddingsUsageResult]] = {}
    for sums in usage_sums(session, query):
        by_bucket.setdefault(sums.bucket, []).append(
            EmbeddingsUsageResult(
                input_tokens=sums.input_tokens,
                num_model_requests=sums.requests,
                api_key_id=sums.api_key_id,
                model=sums.model,
            )
        )
    return window.page(EmbeddingsUsagePage, by_bucket)


@router.get("/costs", response_model=CostsPage, responses=error_responses(400, 401))
def costs(
    request: Request, scope: UsageScopeDep, session: SessionDep, services: ServicesDep
) -> CostsPage:
    """What the usage cost at the configured prices, in daily buckets: batch tokens at the
    batch discount, each model's input, cached input and output its own line items."""
    params = _Params(request)
    window = _window(params, COST_WIDTHS)
    group_by = _group_by(params, COST_GROUPS)
    wanted = set(params.values("line_items"))
    settings = services.settings
    query = window.records(
        group_by=frozenset({"model", "batch"} | ({"api_key_id"} & group_by)),
        owners=_owners(params, scope),
    )
    totals: dict[tuple[int, str | None, str | None], list[float]] = {}
    for sums in usage_sums(session, query):
        for item in sums.line_items(settings.prices, settings.batch_discount):
            if wanted and item.name not in wanted:
                continue
            key = (
                sums.bucket,
                item.name if "line_item" in group_by else None,
                sums.api_key_id if "api_key_id" in group_by else None,
            )
            total = totals.setdefault(key, [0.0, 0])
            total[0] += item.usd
            total[1] += item.tokens
    by_bucket: dict[int, list[CostResult]] = {}
    for (at, line_item, api_key_id), (usd, tokens) in sorted(totals.items(), key=str):
        by_bucket.setdefault(at, []).append(
            CostResult(
                amount=Amount(value=usd),
                line_item=line_item,
                api_key_id=api_key_id,
                quantity=tokens if line_item is not None else None,
                quantity_unit="tokens" if line_item is not None else None,
            )
        )
    return window.page(CostsPage, by_bucket)


def _result(sums: UsageSums) -> CompletionsUsageResult:
    return CompletionsUsageResult(
        input_tokens=sums.input_tokens,
        output_tokens=sums.output_tokens,
        input_cached_tokens=sums.cached_tokens,
        input_image_tokens=sums.image_tokens,
        input_audio_tokens=sums.audio_tokens,
        num_model_requests=sums.requests,
        api_key_id=sums.api_key_id,
        model=sums.model,
        batch=sums.batch,
    )


class _Params:
    """The query string, read as OpenAI's SDK writes it (`name[]=a&name[]=b` for lists)."""

    def __init__(self, request: Request) -> None:
        self._query = request.query_params

    def _one(self, name: str) -> str | None:
        values = self._query.getlist(name)
        if len(values) > 1:
            raise OpenAIError(f"{name} may be given once.", param=name)
        return values[0] if values else None

    def integer(self, name: str, required: bool = False) -> int | None:
        raw = self._one(name)
        if raw is None:
            if required:
                raise OpenAIError(f"Missing required parameter: '{name}'.", param=name)
            return None
        if not raw.isdigit() or len(raw) > 12:
            raise OpenAIError(f"{name} must be a non-negative integer.", param=name)
        return int(raw)

    def boolean(self, name: str) -> bool | None:
        raw = self._one(name)
        if raw is None:
            return None
        if raw not in ("true", "false"):
            raise OpenAIError(f"{name} must be true or false.", param=name)
        return raw == "true"

    def choice(self, name: str, choices: dict[str, object], default: str) -> str:
        raw = self._one(name) or default
        if raw not in choices:
            raise OpenAIError(f"{name} must be one of {', '.join(choices)}.", param=name)
        return raw

    def values(self, name: str) -> list[str]:
        values = [*self._query.getlist(name), *self._query.getlist(f"{name}[]")]
        if len(values) > MAX_FILTER_VALUES or any(len(v) > 256 for v in values):
            raise OpenAIError(f"{name} holds too many or too long values.", param=name)
        return values


@router.get(
    "/spend_limit",
    response_model=SpendLimitObject,
    dependencies=[Depends(require_admin)],
    responses=error_responses(401, 404),
)
def get_spend_limit(request: Request, session: SessionDep) -> SpendLimitObject:
    limit = session.get(SpendLimit, ORGANIZATION)
    if limit is None:
        raise OpenAIError("No spend limit is set.", status_code=404, code="not_found")
    return _spend_limit(limit, request.app.state.spend)


@router.post(
    "/spend_limit",
    response_model=SpendLimitObject,
    dependencies=[Depends(require_admin)],
    responses=error_responses(400, 401),
    openapi_extra=json_body(SpendLimitUpdate),
)
def set_spend_limit(
    request: Request, session: SessionDep, body: Annotated[Any, Body()] = None
) -> SpendLimitObject:
    """Create or replace the service's hard monthly spend limit, in cents."""
    params = parse_request(SpendLimitUpdate, body)
    values = {
        "threshold_cents": params.threshold_amount,
        "currency": params.currency,
        "interval": params.interval,
        "updated_at": now(),
    }
    if "notification_channel" in params.model_fields_set:
        channel = params.notification_channel
        values["notification_channel"] = channel.model_dump() if channel else None
    with session.begin():
        limit = session.get(SpendLimit, ORGANIZATION, with_for_update=True)
        if limit is None:
            limit = SpendLimit(id=ORGANIZATION, notification_channel=None, **values)
            session.add(limit)
        else:
            for name, value in values.items():
                setattr(limit, name, value)
    return _spend_limit(limit, request.app.state.spend)


@router.delete(
    "/spend_limit",
    response_model=SpendLimitDeleted,
    dependencies=[Depends(require_admin)],
    responses=error_responses(401),
)
def delete_spend_limit(session: SessionDep) -> SpendLimitDeleted:
    with session.begin():
        deleted = session.execute(delete(SpendLimit).where(SpendLimit.id == ORGANIZATION))
    return SpendLimitDeleted(deleted=deleted.rowcount == 1)


def _spend_limit(limit: SpendLimit, spend: SpendGuard) -> SpendLimitObject:
    enforcing = spend.spent_usd() * 100 >= limit.threshold_cents
    return SpendLimitObject(
        currency=limit.currency,
        interval=limit.interval,
        threshold_amount=limit.threshold_cents,
        notification_channel=limit.notification_channel,
        enforcement={"status": "enforcing" if enforcing else "inactive"},
    )

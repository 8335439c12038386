"""The admin API's usage, read from the usage ledger (store/usage.py).

An admin key (`PAGEDBATCH_ADMIN_KEYS`; the SDK's `admin_api_key`) reads every tenant's usage; a
tenant's own key reads its own through the same endpoints, never another's.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedbatch.api.auth import UsageScopeDep
from pagedbatch.api.deps import SessionDep
from pagedbatch.api.organization.schemas import CompletionsUsageResult, UsageBucket, UsagePage
from pagedbatch.api.routes.openapi import error_responses
from pagedbatch.ids import now
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.store.usage import UsageQuery, UsageSums, usage_sums

router = APIRouter(prefix="/organization", tags=["organization"])

# Bucket width: (seconds, buckets a page holds by default, at most), as OpenAI has them.
WIDTHS = {"1m": (60, 60, 1440), "1h": (3600, 24, 168), "1d": (86400, 7, 31)}
GROUPS = ("model", "batch", "api_key_id")
MAX_FILTER_VALUES = 100


@router.get(
    "/usage/completions",
    response_model=UsagePage,
    responses=error_responses(400, 401),
)
def completions_usage(request: Request, scope: UsageScopeDep, session: SessionDep) -> UsagePage:
    """Tokens and requests of chat and completions, realtime and batch, in time buckets."""
    params = _Params(request)
    width, default_limit, most = WIDTHS[params.choice("bucket_width", WIDTHS, "1d")]
    start = params.integer("start_time", required=True)
    end = params.integer("end_time") or now() + 1
    if end <= start:
        raise OpenAIError("end_time must be after start_time.", param="end_time")
    limit = params.integer("limit") or default_limit
    if not 1 <= limit <= most:
        raise OpenAIError(
            f"limit must be between 1 and {most} for this bucket width.", param="limit"
        )
    first = params.integer("page") or start - start % width
    if first % width or first < start - start % width:
        raise OpenAIError("page is not a cursor this query gave.", param="page")
    group_by = params.values("group_by")
    if unknown := set(group_by) - set(GROUPS):
        raise OpenAIError(
            f"group_by: {sorted(unknown)[0]!r} is not supported; use {', '.join(GROUPS)}.",
            param="group_by",
        )
    keys = params.values("api_key_ids")
    owners = frozenset(keys) if keys else None
    if scope is not None:  # a tenant reads its own usage only
        owners = frozenset({scope}) & owners if owners is not None else frozenset({scope})
    stop = min(end, first + limit * width)
    query = UsageQuery(
        start=max(start, first),
        end=stop,
        width=width,
        group_by=frozenset(group_by),
        owners=owners,
        models=frozenset(models) if (models := params.values("models")) else None,
        batch=params.boolean("batch"),
    )
    by_bucket: dict[int, list[CompletionsUsageResult]] = {}
    for sums in usage_sums(session, query):
        by_bucket.setdefault(sums.bucket, []).append(_result(sums))
    buckets = [
        UsageBucket(
            start_time=max(at, start),
            end_time=min(at + width, end),
            results=by_bucket.get(at, []),
        )
        for at in range(first, stop, width)
    ]
    more = stop < end
    return UsagePage(data=buckets, has_more=more, next_page=str(stop) if more else None)


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

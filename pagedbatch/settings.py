"""Every setting of the service, in one place: environment (`PAGEDBATCH_*`) or CLI flags.

The engine's settings are not restated here: EngineSettings derives them from EngineArgs's
fields (type, default, bounds, choices, doc), so `PAGEDBATCH_MAX_NUM_SEQS` is EngineArgs's
`max_num_seqs`, under one name everywhere.

Unset storage settings mean the embedded deployment: SQLite and a local directory under
`data_dir`, and an in-process queue. Setting `database_url`, `broker_url` and `s3_bucket` selects
the distributed one (PostgreSQL, Redis and S3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_type_hints

from pydantic import AfterValidator, BeforeValidator, Field, create_model, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pagedbatch.costs import ModelPrice, prices_from
from pagedbatch.engine.config import EngineArgs
from pagedbatch.logs import LogFormat
from pagedbatch.moderation import (
    LEVELS,
    Category,
    Checks,
    TenantSafety,
    Threshold,
    blocklist,
    threshold,
)

DAY = 24 * 3600
ENV_PREFIX = "PAGEDBATCH_"


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")


def _engine_setting(arg: dataclasses.Field, hint: Any) -> tuple[Any, Any]:
    """An EngineArgs field as a setting (type, default, bounds, choices, description). The
    default is the service's where it has one of its own, and None for the one field the
    engine requires (`model`: the service then serves its default model)."""
    meta = arg.metadata
    default = meta.get("service_default", arg.default)
    if default is dataclasses.MISSING:
        default = None
    if meta["choices"] is not None:
        hint = Literal[meta["choices"]]
    # As EngineArgs refuses them: inf and nan are no value a setting means.
    finite = {"allow_inf_nan": False} if float in get_args(hint) or hint is float else {}
    if default is None:
        hint = hint | None
    return hint, Field(default, description=meta["doc"], ge=meta["ge"], gt=meta["gt"], **finite)


_hints = get_type_hints(EngineArgs)
# The engine's settings; Settings adds the service's own.
EngineSettings = create_model(
    "EngineSettings",
    __base__=_Settings,
    __doc__="EngineArgs's fields as settings; Settings.engine_args() gives them to the engine.",
    **{arg.name: _engine_setting(arg, _hints[arg.name]) for arg in dataclasses.fields(EngineArgs)},
)
ENGINE_SETTINGS = tuple(f.name for f in dataclasses.fields(EngineArgs))


class Settings(EngineSettings):
    # Where things live.
    data_dir: Path = Path("data")
    database_url: str | None = None  # default: SQLite in data_dir
    broker_url: str | None = None  # Redis URL; unset: in-process queue
    s3_endpoint_url: str | None = None
    s3_bucket: str | None = None  # set: files in S3 (boto3 credentials from the environment)
    s3_addressing_style: str = "path"

    # HTTP.
    host: str = "127.0.0.1"
    port: int = 8000
    # Host names the API answers to besides `host` and localhost (any loopback address), any
    # port; comma-separated in the environment. A request naming another host is refused (400):
    # a DNS-rebinding page names its own. Bound to 0.0.0.0, list the names clients use.
    allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Web origins (`https://app.example.com`, or `*` for any) whose pages may call the API; a
    # request from any other page's origin is refused (403). Comma-separated in the environment.
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Comma-separated in the environment. Empty: no auth, one shared tenant.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Keys that read every tenant's usage (`/v1/organization/...`, the SDK's `admin_api_key`).
    admin_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # What usage costs (pagedbatch/costs.py): inline JSON or a JSON file's path, per served model
    # name {"input", "cached_input", "output"} in USD per million tokens; batch tokens at the
    # discount's fraction of those prices.
    prices: Annotated[dict[str, ModelPrice], NoDecode, BeforeValidator(prices_from)] = Field(
        default_factory=dict
    )
    batch_discount: float = Field(0.5, ge=0, le=1)
    # Each API key's monthly spend limit at those prices (store/spend.py): a request or batch line
    # whose worst case could take the key past it is refused (429 insufficient_quota); None: no
    # limit. The service's is set through the API. Set it alike on the API and the workers.
    key_monthly_spend_limit_usd: float | None = Field(None, ge=0)
    # A running request's spend reservation lapses this long after its process last renewed it
    # (every third of this): a process that died gives back what its requests held within it.
    spend_reservation_seconds: float = Field(60.0, ge=1, le=3600)
    # `pagedbatch serve` refuses to listen beyond loopback without api_keys unless this is on:
    # an open port would give anyone who reaches it the engine and every file and batch.
    allow_unauthenticated: bool = False
    # A JSON request body larger than this is refused with a 413 as it streams in, before it is
    # parsed (uploads have max_upload_bytes instead); 2 MiB holds far more text than a context.
    max_request_body_bytes: int = Field(2 * 2**20, ge=2**10, le=2**28)

    # Log lines on stderr: "text", or "json" (an object a line, with the request id in requests).
    log_format: LogFormat = "text"

    # Observability. A worker serves /metrics on this port (at `host`); 0: not at all. The API
    # serves /metrics on its own port.
    worker_metrics_port: int = Field(8001, ge=0)
    # The bearer token the API's /metrics requires (Prometheus: `authorization.credentials`).
    # With api_keys set and no token, /metrics answers 403: it tells of every tenant's work.
    metrics_token: str | None = None
    # The job store's figures on /metrics are read at most this often (they are GROUP BYs over
    # whole tables); scrapes in between get the last reading.
    metrics_cache_seconds: float = Field(10.0, ge=0, le=300)

    # Realtime work: sequences (prompts × n of each request) admitted into an engine at once,
    # waiting or running, per engine; beyond it clients get a 429 with Retry-After rather than an
    # ever longer wait, and a request needing more than a tenant's share can hold is a 400.
    max_realtime_queue: int = Field(256, ge=1, le=2**20)
    # A tenant may hold at most this fraction of max_realtime_queue. Tenants take turns for the
    # room whatever it is (the fewest held first; a refused tenant's room is kept for its retry);
    # below 1 another tenant's first request also finds room at once; 1 lends a lone tenant all.
    realtime_tenant_share: float = Field(1.0, gt=0, le=1)
    # A streaming client that takes longer than this to accept the next piece of its stream has
    # its stream closed and its engine requests aborted: a reader that stalls holds no slot.
    stream_send_timeout_seconds: float = Field(30.0, gt=0, le=3600)
    # Off (the default), each tenant's prompts find only its own cached prefixes (the engine's
    # cache_salt is the tenant): cached_tokens and first-token latency then tell nothing of
    # other tenants' prompts. On, all tenants share one prefix cache, which saves more compute.
    share_prefix_cache_across_tenants: bool = False

    # Distributed realtime work: each worker's engine host serves the realtime endpoints over
    # HTTP at engine_host:engine_port (0: any free port) and heartbeats its address and load into
    # the broker's Redis; the API forwards each realtime request to the least loaded live one.
    # engine_address is the URL the API should use (default: http://engine_host:port, with the
    # machine's address when engine_host is 0.0.0.0). Off loopback, engine_secret must be set,
    # on the workers and the API alike: the engine host then answers only requests bearing it.
    engine_host: str = "127.0.0.1"
    engine_port: int = Field(0, ge=0, le=65535)
    engine_address: str | None = None
    engine_secret: str | None = None
    engine_heartbeat_seconds: float = Field(1.0, gt=0)  # a host is gone after 3 missed beats

    # Batch work.
    completion_window_seconds: int = DAY  # how long a batch may run before it expires
    shard_size: int = 256  # requests per shard
    worker_concurrency: int = 2  # shards one engine runs at once (embedded; workers' default)
    lease_seconds: float = 60.0  # a shard's lease; its worker renews it at a third of this
    # A shard writes its finished lines a flush at a time, one transaction each: once this many
    # wait or the oldest has waited this many ms, whichever comes first. request_counts move a
    # flush at a time; a worker that dies loses (and its shard's next run redoes) at most those.
    result_flush_lines: int = Field(64, ge=1, le=10_000)
    # A second: each flush is two commits (the pool's pre-ping and the write), so on a CPU engine
    # finishing a few lines a second, shorter windows cost more commits than lines.
    result_flush_ms: int = Field(1000, ge=0, le=60_000)
    # The slower upkeep jobs (expiring batches, re-driving stuck finalizations, sweeping
    # webhooks, deleting expired files) run this often; reaping shards runs every upkeep tick.
    reaper_interval_seconds: float = Field(15.0, gt=0, le=3600)
    # Every process that runs tasks (each worker, the embedded server) fires upkeep this often;
    # a database lock lets one of them do it at a time. Seconds, so a dead worker's shards go
    # back within a few; the bound keeps the database from being polled in a spin.
    upkeep_interval_seconds: float = Field(2.0, ge=0.1, le=60)
    # Each such process writes a heartbeat row this often; one silent for 3 beats is dead and
    # its shards are re-leased at once, without waiting for their leases to lapse.
    worker_heartbeat_seconds: float = Field(2.0, ge=0.1, le=60)
    # A batch `validating` this long has lost its validation task (a broker restart): it is
    # queued again, then again after as long; a second run builds on the rows the first staged.
    validation_redrive_seconds: float = Field(600.0, ge=10, le=DAY)
    # Validation rides out a database or S3 outage this long (retrying with backoff), then
    # leaves the batch validating for the redrive above: an outage never fails a batch.
    validation_outage_seconds: float = Field(120.0, ge=0, le=3600)
    # A shard claimed this many times without finishing (its worker crashed or lost the lease
    # each time) is not claimed again: its unfinished lines fail with `shard_failed`, so one
    # poisonous shard cannot crash-loop workers for ever nor hold its batch open.
    max_shard_attempts: int = Field(5, ge=1, le=100)
    max_upload_bytes: int = 512 * 2**20
    max_batch_file_bytes: int = 200 * 2**20
    max_batch_lines: int = 50_000

    # Webhooks. A failed delivery is retried with exponential backoff and jitter, from the
    # initial to the maximum delay, up to max_attempts tries: by default about three days.
    webhook_max_attempts: int = Field(24, ge=1)
    webhook_initial_backoff_seconds: float = Field(10.0, gt=0)
    webhook_max_backoff_seconds: float = Field(6 * 3600.0, gt=0)
    webhook_timeout_seconds: float = Field(15.0, gt=0)  # each of connect, send and read
    # An attempt's whole exchange, however its receiver trickles bytes under the timeout above;
    # a delivery thread is never held longer.
    webhook_attempt_deadline_seconds: float = Field(30.0, gt=0, le=600)
    # Attempts one tenant may have in flight at once, over all workers: its slow endpoints
    # cannot take every delivery thread; its other messages wait a second or two.
    webhook_tenant_concurrency: int = Field(2, ge=1, le=100)
    # A message due this long with no attempt has lost its task (a crash, a restart) and is
    # queued again by the sweep; shorter would queue again messages still waiting in a busy
    # queue.
    webhook_requeue_after_seconds: float = Field(300.0, ge=0, le=DAY)
    # Webhook endpoints a tenant may register (400 beyond): each event fans out to all of them.
    webhook_max_endpoints_per_tenant: int = Field(20, ge=1, le=1000)
    webhook_secret_grace_seconds: int = DAY  # a rotated-out secret keeps signing this long
    # Hosts, addresses or networks (10.0.0.0/8) webhooks may reach although they are loopback,
    # private or link-local; comma-separated in the environment.
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # Retention, applied by upkeep in bounded chunks; 0 keeps for good. A finished batch's
    # requests (bodies and results) go this long after it ended: its output and error files
    # and the batch object stay (they expire on their own terms). A batch's output and error
    # files expire batch_output_retention_days after they were written, unless the batch set
    # its own `output_expires_after` (OpenAI keeps them 30 days); their blobs go with them. A
    # finished batch itself (what retrieve and list show) is purged batch_retention_days after
    # it ended, and is then a 404. Delivered or failed webhook
    # messages and every delivery attempt go after webhook_retention_days; idempotency keys
    # after idempotency_key_retention_hours (a retry comes within minutes; OpenAI keeps 24 h).
    # The usage ledger's records go after usage_retention_days (a year and a month of usage
    # and costs to read back by default). A stored response (`/v1/responses` with `store`)
    # expires response_retention_days after it was created (OpenAI keeps them 30 days): then a
    # 404, and deleted by upkeep with its blobs.
    batch_data_retention_days: float = Field(30.0, ge=0, le=3650)
    batch_output_retention_days: float = Field(30.0, ge=0, le=3650)
    batch_retention_days: float = Field(400.0, ge=0, le=3650)
    webhook_retention_days: float = Field(7.0, ge=0, le=3650)
    idempotency_key_retention_hours: float = Field(24.0, ge=0, le=24 * 3650)
    usage_retention_days: float = Field(400.0, ge=0, le=3650)
    response_retention_days: float = Field(30.0, ge=0, le=3650)
    # What a request continuing a conversation (`previous_response_id`) may read of it, newest
    # first: at most this many earlier responses and bytes of their stored documents. Older
    # turns are dropped under `truncation: auto`; otherwise the request is refused.
    response_history_max_turns: int = Field(1000, ge=1, le=1_000_000)
    response_history_max_bytes: int = Field(16 * 2**20, ge=2**10, le=2**34)

    # Safety: a sequence classifier checkpoint (its labels OpenAI's moderation categories, as
    # `make-model --task classify` writes) serves /v1/moderations, on an engine of its own beside
    # the main one, with a KV budget and sequence limit of its own.
    moderation_model: str | None = None
    moderation_kv_cache_memory_gib: float = Field(0.25, gt=0, le=1024)
    moderation_max_num_seqs: int = Field(32, ge=1, le=1024)
    max_moderation_inputs: int = Field(32, ge=1, le=1024)  # inputs in one moderation request
    # An embedding model (a sentence-transformers folder, a decoder with a pooling config, or a
    # name of pagedbatch.pypi_models) served under its own name beside the main one, for
    # /v1/embeddings, on an engine of its own with a KV budget and sequence limit of its own.
    embedding_model: str | None = None
    embedding_kv_cache_memory_gib: float = Field(0.25, gt=0, le=1024)
    embedding_max_num_seqs: int = Field(64, ge=1, le=1024)
    # The score from which a category counts as flagged: a number in [0, 1], or a level
    # (`pagedbatch.moderation.LEVELS`).
    safety_threshold: Annotated[float, BeforeValidator(threshold)] = LEVELS["medium"]
    # The content filter on the doors (docs/api.md, "Safety"): which way it screens, per-category
    # thresholds (JSON: {"hate": "low", "violence": 0.9}), a blocklist of regular expressions
    # (JSON list) checked before any model, and per-tenant overrides of any of these (JSON:
    # {"<API key id>": {"policy", "threshold", "categories", "blocklist"}}).
    safety_policy: Checks = "off"
    safety_category_thresholds: dict[Category, Threshold] = Field(default_factory=dict)
    safety_blocklist: Annotated[list[str], AfterValidator(blocklist)] = Field(default_factory=list)
    safety_tenants: dict[str, TenantSafety] = Field(default_factory=dict)
    # Output is screened every this many generated tokens (and at its end); a stream holds back
    # text until it has been.
    safety_output_check_tokens: int = Field(32, ge=1, le=4096)

    @field_validator(
        "api_keys",
        "admin_keys",
        "webhook_allowed_hosts",
        "allowed_hosts",
        "cors_origins",
        mode="before",
    )
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @cached_property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'pagedbatch.db').resolve()}"

    @property
    def distributed(self) -> bool:
        return self.broker_url is not None

    def engine_args(self) -> dict[str, Any]:
        """The engine's settings, as EngineArgs keywords (`model` None: not set)."""
        return {name: getattr(self, name) for name in ENGINE_SETTINGS}


# The kernels' process-wide switches (docs/configuration.md's kernels paragraph): read from the
# environment where each kernel is chosen (kernels/ops.py, native.py, quant_linear.py), in every
# process that runs an engine and in tools that run no service, so they are no Settings fields.
KERNEL_VARIABLES = (
    "PAGEDBATCH_KERNELS",
    "PAGEDBATCH_NATIVE_KERNELS",
    "PAGEDBATCH_QUANT_ACTIVATIONS",
    "PAGEDBATCH_QUANT_GEMM",
)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """`PAGEDBATCH_*` variables in `environ` that name no setting: a typo, or a name from an
    older release, which would otherwise be ignored without a word."""
    known = {f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields}
    known.update(KERNEL_VARIABLES)
    return sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)

"""Every setting of the service, in one place: environment (`PAGEDBATCH_*`) or CLI flags.

Unset storage settings mean the embedded deployment: SQLite and a local directory under
`data_dir`, and an in-process queue. Setting `database_url`, `broker_url` and `s3_bucket` selects
the distributed one (PostgreSQL, Redis and S3).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pagedbatch.logs import LogFormat

DAY = 24 * 3600


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDBATCH_", extra="ignore")

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
    # Comma-separated in the environment. Empty: no auth, one shared tenant.
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)

    # Log lines on stderr: "text", or "json" (an object a line, with the request id in requests).
    log_format: LogFormat = "text"

    # Observability. Each engine logs a stats line (throughput, running, waiting, KV usage) this
    # often while it has work; 0: never. A worker serves /metrics on this port (at `host`); 0:
    # not at all. The API serves /metrics on its own port.
    stats_log_interval_seconds: float = Field(5.0, ge=0)
    worker_metrics_port: int = Field(8001, ge=0)

    # The model; unset: the built-in tiny demo model, made on first start.
    model: str | None = None
    served_model_name: str | None = None
    # Ranks the model is split across: a worker's engine claims this many GPUs (cuda:0 on; pick
    # them with CUDA_VISIBLE_DEVICES), or runs this many processes on CPU.
    tensor_parallel_size: int = Field(1, ge=1)

    # Realtime work: requests admitted into the engine at once (waiting or running), per API
    # process; beyond it clients get a 429 with Retry-After rather than an ever longer wait.
    max_realtime_queue: int = 256
    # While realtime requests are in an engine, batch lines get at most this many tokens a step
    # (0: no bound but the engine's step budget): the smaller, the shorter the steps realtime
    # requests wait on, and the less batch throughput while they run.
    batch_tokens_under_realtime: int = Field(512, ge=0)

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
    reaper_interval_seconds: float = 15.0
    max_upload_bytes: int = 512 * 2**20
    max_batch_file_bytes: int = 200 * 2**20
    max_batch_lines: int = 50_000

    # Webhooks. A failed delivery is retried with exponential backoff and jitter, from the
    # initial to the maximum delay, up to max_attempts tries: by default about three days.
    webhook_max_attempts: int = Field(24, ge=1)
    webhook_initial_backoff_seconds: float = Field(10.0, gt=0)
    webhook_max_backoff_seconds: float = Field(6 * 3600.0, gt=0)
    webhook_timeout_seconds: float = Field(15.0, gt=0)  # connect, send and read, per attempt
    webhook_secret_grace_seconds: int = DAY  # a rotated-out secret keeps signing this long
    # Hosts, addresses or networks (10.0.0.0/8) webhooks may reach although they are loopback,
    # private or link-local; comma-separated in the environment.
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @field_validator("api_keys", "webhook_allowed_hosts", mode="before")
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

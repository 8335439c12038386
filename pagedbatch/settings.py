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

    # The model; unset: the built-in tiny demo model, made on first start.
    model: str | None = None
    served_model_name: str | None = None

    # Realtime work: requests admitted into the engine at once (waiting or running), per API
    # process; beyond it clients get a 429 with Retry-After rather than an ever longer wait.
    max_realtime_queue: int = 256

    # Batch work.
    completion_window_seconds: int = DAY  # how long a batch may run before it expires
    shard_size: int = 256  # requests per shard
    worker_concurrency: int = 2  # shards one engine runs at once (embedded; workers' default)
    lease_seconds: float = 60.0  # a shard's lease; its worker renews it at a third of this
    reaper_interval_seconds: float = 15.0
    max_upload_bytes: int = 512 * 2**20
    max_batch_file_bytes: int = 200 * 2**20
    max_batch_lines: int = 50_000

    @field_validator("api_keys", mode="before")
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

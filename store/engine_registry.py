"""Where the engine hosts of the distributed deployment are, and how busy: records in Redis.

Each worker's engine host writes its record under a key of its own at every heartbeat, and the
key expires after MISSED_BEATS heartbeats: a host that dies drops out within seconds without
anyone cleaning up after it, and one that stops cleanly deletes its key at once. The API reads
the records to route realtime requests (api/engine_proxy.py). The broker's Redis holds them, so
a distributed deployment needs nothing more.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from redis.asyncio import Redis

KEY_PREFIX = "pagedbatch:engines:"
MISSED_BEATS = 3  # a record outlives this many heartbeats, so one late beat loses nothing


@dataclass(frozen=True)
class EngineRecord:
    id: str  # the worker's id, unique per process
    address: str  # the engine host's base URL
    model: str  # the served model name
    running: int  # requests the engine generates for, batch lines included
    waiting: int  # requests queued in the engine, preempted ones included
    kv_usage: float  # fraction of the KV-cache blocks in use
    admitted: int  # realtime requests in the engine
    max_admitted: int  # beyond this many, realtime requests get a 429
    beat: int  # counts this host's heartbeats: a new value means new figures
    tokens_per_second: float | None = None  # generated, over about the last 10 s
    settings: dict[str, Any] = field(default_factory=dict)  # the engine's, in force
    resident: dict[str, int] | None = None  # what its model holds in memory (ResidentSize)
    # The LoRA adapters its engine serves: requests name them as models, and are routed here.
    adapters: list[str] = field(default_factory=list)

    def serves(self, model: str) -> bool:
        return model == self.model or model in self.adapters

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> EngineRecord:
        return cls(**json.loads(raw))


def record_key(engine_id: str) -> str:
    return KEY_PREFIX + engine_id


def record_ttl_seconds(heartbeat_seconds: float) -> float:
    return MISSED_BEATS * heartbeat_seconds


async def publish(redis: Redis, record: EngineRecord, heartbeat_seconds: float) -> None:
    ttl_ms = max(1, round(record_ttl_seconds(heartbeat_seconds) * 1000))
    await redis.set(record_key(record.id), record.to_json(), px=ttl_ms)


async def withdraw(redis: Redis, engine_id: str) -> None:
    await redis.delete(record_key(engine_id))


async def live_engines(redis: Redis) -> list[EngineRecord]:
    """The records of every engine host that heartbeated lately."""
    keys = [key async for key in redis.scan_iter(match=KEY_PREFIX + "*", count=1000)]
    if not keys:
        return []
    # A key may expire between the scan and the read: it is then None, and left out.
    return [EngineRecord.from_json(raw) for raw in await redis.mget(keys) if raw is not None]

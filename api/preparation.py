"""The realtime door's preparation threads, shared fairly among tenants.

Parsing, templating, tokenizing and decoding media take seconds of CPU, so they run on threads,
never on the event loop (api/realtime.py). There are two lanes of threads, so that waiting on
other hosts never holds up CPU work:

- `work` (PREPARE_THREADS): everything but what follows;
- `fetching` (FETCH_THREADS): preparing a request that fetches media (http(s) image URLs), which
  may wait on their hosts for up to `media_fetch_deadline_seconds`; one tenant holds at most
  FETCH_THREADS_PER_TENANT of them.

In each lane a thread that frees goes to the waiting tenant holding the fewest (`FairLimiter`):
a tenant gets no more threads while others holding fewer wait. So a request with
nothing to fetch never waits behind a fetch, and one tenant's slow image hosts delay only its
own requests, as long as fewer than FETCH_THREADS / FETCH_THREADS_PER_TENANT tenants fetch at
once (beyond that, a fetching request waits at most for one other's deadline).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from pagedbatch.store.models import DEFAULT_OWNER

T = TypeVar("T")

PREPARE_THREADS = 4
FETCH_THREADS = 8
FETCH_THREADS_PER_TENANT = 2

# Whose request the door is preparing: set once per request, so that every step it runs on a
# thread (parsing, spend checks, preparing, rendering) counts against that tenant's share.
preparing_for: ContextVar[str] = ContextVar("preparing_for", default=DEFAULT_OWNER)


class FairLimiter:
    """At most `capacity` holders at once, shared fairly among tenants.

    A place that is free or frees goes to the waiting tenant holding the fewest (the longest
    waiting among equals), and a tenant never holds more than `per_tenant`. So a tenant alone
    may hold everything up to its limit, but while others wait it gets no more until they hold
    as many as it does (max-min fairness); nothing held is taken back, so a newcomer waits at
    most until the first holder leaves. Each tenant's own requests go in the order they came.

    Routes run on one event loop, so plain counters are exact.
    """

    def __init__(self, capacity: int, per_tenant: int | None = None) -> None:
        self.capacity = capacity
        self.per_tenant = capacity if per_tenant is None else per_tenant
        self.held: Counter[str] = Counter()
        self._waiting: dict[str, deque[tuple[int, asyncio.Future[None]]]] = {}
        self._arrivals = itertools.count()

    @asynccontextmanager
    async def hold(self, tenant: str) -> AsyncIterator[None]:
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release(tenant)

    async def _acquire(self, tenant: str) -> None:
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (next(self._arrivals), turn)
        self._waiting.setdefault(tenant, deque()).append(entry)
        self._grant()
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release(tenant)  # granted just as its waiter was cancelled
            else:
                self._withdraw(tenant, entry)
            raise

    def _grant(self) -> None:
        while sum(self.held.values()) < self.capacity:
            under = [
                (self.held[tenant], line[0][0], tenant)
                for tenant, line in self._waiting.items()
                if self.held[tenant] < self.per_tenant
            ]
            if not under:
                return
            _, _, tenant = min(under)
            _, turn = self._waiting[tenant].popleft()
            if not self._waiting[tenant]:
                del self._waiting[tenant]
            if not turn.done():  # else its waiter was cancelled
                self.held[tenant] += 1
                turn.set_result(None)

    def _withdraw(self, tenant: str, entry: tuple[int, asyncio.Future[None]]) -> None:
        line = self._waiting.get(tenant)
        if line is not None and entry in line:
            line.remove(entry)
            if not line:
                del self._waiting[tenant]
        self._grant()  # it may have been first in line, waiting for its own to leave

    def _release(self, tenant: str) -> None:
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]
        self._grant()


@dataclass
class Lane:
    """Threads for one kind of preparation, shared fairly by tenants."""

    capacity: int
    per_tenant: int | None = None
    fair: FairLimiter = field(init=False)
    threads: anyio.CapacityLimiter = field(init=False)  # never the bound: `fair` is

    def __post_init__(self) -> None:
        self.fair = FairLimiter(self.capacity, self.per_tenant)
        self.threads = anyio.CapacityLimiter(self.capacity)

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on a thread of this lane, for the tenant whose request is prepared."""
        async with self.fair.hold(preparing_for.get()):
            return await anyio.to_thread.run_sync(work, *args, limiter=self.threads)


@dataclass
class Preparation:
    """The two lanes (see the module's docstring)."""

    work: Lane = field(default_factory=lambda: Lane(PREPARE_THREADS))
    fetching: Lane = field(
        default_factory=lambda: Lane(FETCH_THREADS, per_tenant=FETCH_THREADS_PER_TENANT)
    )

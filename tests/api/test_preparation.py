"""The preparation threads' fair limiter: a tenant alone may use them all, but a thread that
frees goes to the waiting tenant holding the fewest, and no tenant passes its own limit."""

from __future__ import annotations

import asyncio
import contextlib

from pagedbatch.api.preparation import FairLimiter


async def holders(limiter: FairLimiter, tenants: list[str]) -> list[asyncio.Task[None]]:
    """A task per tenant in `tenants`, each holding a place until cancelled; returns once each
    has either got its place or is waiting."""
    release = asyncio.Event()

    async def hold(tenant: str) -> None:
        async with limiter.hold(tenant):
            await release.wait()

    tasks = [asyncio.create_task(hold(tenant), name=tenant) for tenant in tenants]
    await asyncio.sleep(0)
    return tasks


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def end(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await settle()


def test_a_freed_thread_goes_to_the_waiting_tenant_holding_the_fewest():
    async def main() -> None:
        limiter = FairLimiter(4)
        a = await holders(limiter, ["a"] * 6)  # alone: a takes all four; two wait
        await settle()
        assert limiter.held == {"a": 4}
        b = await holders(limiter, ["b", "b"])
        await settle()
        await end(a[0])
        assert limiter.held == {"a": 3, "b": 1}  # b came later, but holds fewer
        await end(a[1])
        assert limiter.held == {"a": 2, "b": 2}  # again to b, who holds fewer
        await end(b[0])
        assert limiter.held == {"a": 3, "b": 1}  # b wants no more: a's waiting one gets it
        for task in a + b:
            await end(task)
        assert not limiter.held

    asyncio.run(main())


def test_a_tenant_holds_at_most_its_limit_even_alone():
    async def main() -> None:
        limiter = FairLimiter(8, per_tenant=2)
        a = await holders(limiter, ["a"] * 4)
        await settle()
        assert limiter.held == {"a": 2}
        b = await holders(limiter, ["b"])
        await settle()
        assert limiter.held == {"a": 2, "b": 1}  # at once: a's waiting two keep nothing back
        for task in a + b:
            await end(task)

    asyncio.run(main())


def test_a_waiter_that_gives_up_leaves_the_line():
    async def main() -> None:
        limiter = FairLimiter(1)
        a = await holders(limiter, ["a"])
        b = await holders(limiter, ["b", "b"])
        await settle()
        await end(b[0])  # gave up while waiting
        await end(a[0])
        assert limiter.held == {"b": 1}
        await end(b[1])
        assert not limiter.held

    asyncio.run(main())

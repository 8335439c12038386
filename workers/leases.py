"""Keeping a run's lease: a batch's shard (batches/shards.py) or a background response
(responses.py) is leased to the worker that claimed it, and that worker's run keeps the lease
alive while it runs, looking at its work as often as a cancel should reach the engine.

Invariant: a run never writes past its lease. The lease is renewed every third of it; a renewal
that finds it taken (the reaper or upkeep handed the work out again) marks it `lost` and stops the
run, and so does a lease that could not be renewed in time: a look waits until STOP_CHECK_SECONDS
before the lease would lapse at the most, and the lease is lost by the time it would lapse, before
another worker may take the work. The run's writes check `lost`, and the job store checks in each
write's own transaction that this worker still holds the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from pagedbatch.store.retry import is_transient

logger = logging.getLogger(__name__)

STOP_CHECK_SECONDS = 0.5  # how soon a cancel reaches the engine

# A look at the work, on the lease's own thread: given whether to renew the lease, whether the
# run is told to stop (cancelled, expired, deleted) and whether the lease was renewed (False if
# not asked to).
Look = Callable[[bool], tuple[bool, bool]]


class Lease:
    """The lease a run holds on `what` (named in the log) until `leased_until` (time.monotonic()),
    and the `stop` flag that ends the run: raised when the work is told to stop, when this process
    shuts down (`stopping`; then `handing_back` is set, and the run hands its work back at once),
    and when the lease is lost (`lost`).

    A run that still writes once told to stop (a shard writes the results it has) keeps its lease
    until it ends (`renew_after_stop`); any other stops looking at the first stop.
    """

    def __init__(
        self,
        what: str,
        leased_until: float,
        lease_seconds: float,
        look: Look,
        stopping: threading.Event,
        renew_after_stop: bool,
    ) -> None:
        self.what = what
        self.leased_until = leased_until
        self.lease_seconds = lease_seconds
        self.look = look
        self.stopping = stopping
        self.renew_after_stop = renew_after_stop
        self.stop = asyncio.Event()  # the run may raise it too (a shard whose writer failed)
        self.lost = False
        self.handing_back = False

    def lose(self) -> None:
        """Give the run up: another worker may have its work."""
        self.lost = True
        self.stop.set()

    @contextlib.asynccontextmanager
    async def kept(self) -> AsyncIterator[None]:
        """The lease kept, and looked after, while the body runs."""
        # A thread of its own: the run's other database work, slow while the database is
        # struggling, must not delay the look that renews the lease, nor a look stuck on a dead
        # connection hold that work up.
        looks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease-watch")
        watcher = asyncio.create_task(self._watch(looks))
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            looks.shutdown(wait=False)  # a look stuck on a dead connection is not waited for

    async def _watch(self, looks: ThreadPoolExecutor) -> None:
        """Look every STOP_CHECK_SECONDS; a look that fails (the database restarting) is tried
        again at the next tick, unless the lease would lapse first."""
        loop = asyncio.get_running_loop()
        lease = self.lease_seconds
        while True:
            await asyncio.sleep(STOP_CHECK_SECONDS)
            if self.stopping.is_set() and not self.stop.is_set():  # else it ends anyway
                self.handing_back = True
                self.stop.set()
                return
            asked_at = time.monotonic()
            leased_until = self.leased_until
            renew = leased_until - asked_at <= lease * 2 / 3  # every third of the lease
            try:
                async with asyncio.timeout(leased_until - asked_at - STOP_CHECK_SECONDS):
                    told_to_stop, renewed = await loop.run_in_executor(looks, self.look, renew)
            except Exception as e:  # noqa: BLE001 - whatever it is, the lease decides what next
                if time.monotonic() >= leased_until - STOP_CHECK_SECONDS:
                    logger.error(
                        "could not renew the lease of %s in time (%s): stopping it",
                        self.what,
                        type(e).__name__,
                    )
                    self.lose()
                    return
                if is_transient(e):
                    logger.warning("watching %s: %s", self.what, e)
                else:
                    logger.exception("watching %s failed", self.what)
                continue
            if told_to_stop:
                self.stop.set()
                if not self.renew_after_stop:
                    return
            if renew:
                if not renewed:  # the reaper or upkeep took it: another worker may run it
                    self.lose()
                    return
                self.leased_until = asked_at + lease

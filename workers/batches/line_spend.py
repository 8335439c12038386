"""A shard run's spend reservations (store/spend.py): each line reserves its worst case, at the
batch discount, as the shard takes it, and settles in the result flush that writes it, in the
same transaction; a line refused fails with `insufficient_quota`, and the batch goes on.

A reservation lives until its line's result is committed: a flush that is retried settles it
again, one that lost the lease settles nothing, and whatever is left when the run ends (lines
stopped mid-way, a lost lease, a dead engine) is released. A worker killed meanwhile stops
renewing its reservations, and upkeep releases them once they lapse.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from sqlalchemy.orm import Session

from pagedbatch.protocol.errors import insufficient_quota
from pagedbatch.protocol.serving.common import Prepared, ServedModel, worst_case_tokens
from pagedbatch.store.batches import LineResult
from pagedbatch.store.reservations import Reservation, Settlement, forget_all, settle
from pagedbatch.store.retry import retrying
from pagedbatch.store.spend import SpendGuard, SpendRefused
from pagedbatch.workers.context import WorkerContext

logger = logging.getLogger(__name__)


class LineSpend:
    """The reservations of one shard run's lines in flight, by request id."""

    def __init__(self, ctx: WorkerContext, owner: str, model: str) -> None:
        self._guard = SpendGuard(ctx.session_factory, ctx.settings)
        self._owner = owner
        self._model = model
        self._lock = threading.Lock()  # lines reserve on threads while flushes settle on others
        self._held: dict[int, Reservation] = {}

    def reserve(self, request_id: int, served: ServedModel, prepared: Prepared) -> None:
        """Reserve the line's worst case; a 429 `insufficient_quota` if a budget cannot hold it.
        Rides out a database outage."""
        tokens = worst_case_tokens(prepared, served.max_model_len)
        try:
            reservation = retrying(
                lambda: self._guard.reserve(self._owner, self._model, True, *tokens),
                "reserving a batch line's spend",
            )
        except SpendRefused as refused:
            raise insufficient_quota(str(refused)) from None
        if reservation is not None:
            with self._lock:
                self._held[request_id] = reservation

    def settle(
        self, session: Session, results: Sequence[LineResult], written: Sequence[LineResult]
    ) -> dict[int, Settlement]:
        """Settle the reservations of a flush's `results` in its transaction: those `written` at
        what their tokens cost, the others (written already by an earlier run) at nothing; by
        request id. `settled` forgets them once the transaction has committed."""
        costs = {
            r.request_id: self._guard.cost(
                self._model, True, (r.prompt_tokens, r.cached_tokens, r.completion_tokens)
            )
            for r in written
        }
        with self._lock:
            settlements = {
                r.request_id: Settlement(self._held[r.request_id], costs.get(r.request_id, 0))
                for r in results
                if r.request_id in self._held
            }
        settle(session, list(settlements.values()))
        return settlements

    def settled(self, settlements: dict[int, Settlement]) -> None:
        with self._lock:
            for request_id in settlements:
                del self._held[request_id]
        forget_all(settlements.values())

    def release_rest(self) -> None:
        """Release what lines that wrote no result still hold. If the database is away, they
        are left to lapse (upkeep releases them)."""
        with self._lock:
            rest, self._held = list(self._held.values()), {}
        try:
            self._guard.release(rest)
        except Exception:  # noqa: BLE001 - the run is ending either way
            logger.warning("could not release %d spend reservations: left to lapse", len(rest))
            for reservation in rest:
                reservation.forget()

"""A realtime request's spend: its worst case reserved against the spend limits
(store/spend.py) before any engine work, and settled, when it ends, to what its usage-ledger
record costs."""

from __future__ import annotations

from pagedbatch.protocol.errors import insufficient_quota
from pagedbatch.protocol.schemas.common import Usage
from pagedbatch.protocol.serving.common import Prepared, ServedModel, worst_case_tokens
from pagedbatch.store.reservations import Reservation, Settlement
from pagedbatch.store.spend import SpendGuard, SpendRefused
from pagedbatch.store.usage import COMPLETIONS, LedgerWriter
from pagedbatch.store.usage import Usage as LedgerUsage


def open_account(
    guard: SpendGuard,
    ledger: LedgerWriter,
    owner: str,
    served: ServedModel,
    prepared: Prepared,
    kind: str = COMPLETIONS,
) -> Account:
    """A realtime request's account, its worst case reserved: a 429 `insufficient_quota` if
    its key's or the service's budget cannot hold it. `kind`: what its usage counts as
    (store/usage.py). A request of a LoRA adapter is the adapter's, as a batch line naming it
    is."""
    model = next((i.lora_name for i in prepared.inputs if i.lora_name), served.model_name)
    try:
        tokens = worst_case_tokens(prepared, served.max_model_len)
        reservation = guard.reserve(owner, model, False, *tokens)
    except SpendRefused as refused:
        raise insufficient_quota(str(refused)) from None
    return Account(guard, ledger, owner, model, reservation, kind)


class Account:
    """A realtime request's way into the usage ledger. `record` its usage when it ends, which
    settles its reservation at that usage's cost; `close` settles it at nothing if nothing was
    recorded (it failed, or its client left first). Only the first of them counts, so every way
    out may call `close`."""

    def __init__(
        self,
        guard: SpendGuard,
        ledger: LedgerWriter,
        owner: str,
        model: str,
        reservation: Reservation | None,
        kind: str = COMPLETIONS,
    ) -> None:
        self._guard = guard
        self._ledger = ledger
        self._owner = owner
        self._model = model
        self._reservation = reservation
        self._kind = kind
        self._done = False

    def record(self, used: Usage) -> None:
        if self._done:
            return
        self._done = True
        details = used.prompt_tokens_details
        usage = LedgerUsage(
            owner=self._owner,
            model=self._model,
            input_tokens=used.prompt_tokens,
            output_tokens=used.completion_tokens,
            cached_tokens=details.cached_tokens,
            image_tokens=details.image_tokens or 0,
            audio_tokens=details.audio_tokens or 0,
            kind=self._kind,
        )
        settlement = None
        if self._reservation is not None:
            tokens = (usage.input_tokens, usage.cached_tokens, usage.output_tokens)
            settlement = Settlement(self._reservation, self._guard.cost(self._model, False, tokens))
        self._ledger.add(usage, settlement)

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        if self._reservation is not None:
            self._ledger.add(None, Settlement(self._reservation, 0))

"""The engine's side of structured output (structured_output.py): `GrammarRuntime` compiles
grammars against the tokenizer off the engine thread (each cache salt, that is each tenant, on a
lane of its own, within a time budget; cached per salt, least recently used dropped), keeps one
matcher per constrained request, masks the logits of each step in one batched call, and says when
a grammar has ended so the engine stops the request without waiting for EOS. A grammar that
starts after a token (`StructuredOutput.starts_after`, a reasoning model's end of thinking)
leaves its request's tokens free until that token has been sampled.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedbatch.engine.config import EngineArgs

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

    from pagedbatch.engine.core.request import Request
    from pagedbatch.engine.sample.structured_output import StructuredOutput

logger = logging.getLogger(__name__)


GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# And at most this much memory of them (xgrammar's own measure): a compiled grammar holds token
# masks for its states, from 0.2 MB for JSON mode to hundreds of MB.
GRAMMAR_CACHE_BYTES = 256 * 2**20


class GrammarViolation(RuntimeError):
    """A sampled token the request's grammar does not allow (a logits processor unmasked it)."""


class GrammarTooCostly(ValueError):
    """A grammar whose compile ran past its time budget: the output format asked for costs more
    to enforce than the engine gives one request. Its message begins with TOO_COSTLY."""


TOO_COSTLY = "the requested output format took more than"


def too_costly(error: str | None) -> bool:
    """Whether a request's error (RequestOutput.error) is a GrammarTooCostly: the client's
    schema or tools, not the engine, are at fault."""
    return error is not None and TOO_COSTLY in error


@dataclass
class _Job:
    grammar: str
    future: Future


class GrammarRuntime:
    """One engine's grammars and matchers, for constrained requests.

    Only the engine thread calls it. Compilation alone runs off it (xgrammar releases the GIL
    while it compiles): `compile` hands back a future, and the engine admits a request once its
    grammar is ready, stepping the others meanwhile.

    Compiles are laned by cache salt (the tenant, unless tenants share the prefix cache): each
    salt's run one at a time on a thread of its own, so one tenant's compiles never wait behind
    another's. A compile still running `compile_seconds` after it started fails its future with
    GrammarTooCostly, and stays failed in the cache (the same grammar is refused at once
    thereafter); xgrammar cannot be interrupted, so the lane's thread finishes it and drops the
    result, and that salt's later compiles wait for it (one compile at a time a salt is also what
    bounds the CPU one tenant's compiles take). Compiled grammars are cached per salt too, so a
    tenant cannot learn from a fast answer that another sent the same schema.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        compile_seconds: float = EngineArgs.grammar_compile_seconds,
        cache_size: int = GRAMMAR_CACHE_SIZE,
        cache_bytes: int = GRAMMAR_CACHE_BYTES,
    ):
        self.vocab_size = vocab_size
        self.compile_seconds = compile_seconds
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        # By (cache salt, grammar); the bytes of those compiled, as they are found done.
        self._compiled: OrderedDict[tuple[str | None, str], Future[xgr.CompiledGrammar]] = (
            OrderedDict()
        )
        self._sizes: dict[tuple[str | None, str], int] = {}
        self.compiles = 0  # compiles started
        self.cache_hits = 0  # compiles saved by the cache
        self._lanes: dict[str | None, deque[_Job]] = {}  # a salt's waiting compiles
        self._lanes_lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None  # built by the first compile
        self._compiler_lock = threading.Lock()
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        # Requests whose grammar waits for a token (the end of their thinking), by that token.
        self._waiting: dict[str, int] = {}
        # One row of xgrammar's token bitmask (32 tokens a word), made as it makes them.
        words = -(-vocab_size // 32)
        self._scratch = torch.full((1, words), -1, dtype=torch.int32)
        allowed = np.zeros(words * 32, dtype=bool)
        allowed[:vocab_size] = True
        allowed[self._stop_token_ids] = False
        self._non_stop = np.packbits(allowed, bitorder="little").view(np.uint32)

    def compile(
        self, spec: StructuredOutput, salt: str | None = None
    ) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, for requests of cache salt `salt`: from the cache,
        or compiled on the salt's lane."""
        key = (salt, spec.grammar)
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            self.cache_hits += 1
            return future
        future = Future()
        self._compiled[key] = future
        self._evict()
        self.compiles += 1
        job = _Job(spec.grammar, future)
        with self._lanes_lock:
            lane = self._lanes.get(salt)
            if lane is not None:  # its thread takes it next
                lane.append(job)
                return future
            self._lanes[salt] = deque([job])
        threading.Thread(
            target=self._run_lane, args=(salt,), name="pagedbatch-grammar", daemon=True
        ).start()
        return future

    def _evict(self) -> None:
        """Drop the least recently used grammars while there are too many, or while those
        compiled take more than the cache's bytes (the newest stays, whatever its size)."""
        for key, future in self._compiled.items():
            if key not in self._sizes and future.done() and future.exception() is None:
                self._sizes[key] = future.result().memory_size_bytes
        while len(self._compiled) > 1 and (
            len(self._compiled) > self._cache_size or sum(self._sizes.values()) > self._cache_bytes
        ):
            key, _ = self._compiled.popitem(last=False)
            self._sizes.pop(key, None)

    def _run_lane(self, salt: str | None) -> None:
        """A salt's compiles, one after another, until none waits (then the thread ends)."""
        while True:
            with self._lanes_lock:
                lane = self._lanes[salt]
                if not lane:
                    del self._lanes[salt]
                    return
                job = lane.popleft()
            self._run(job)

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            self._compiler_ready()  # once an engine, and not a request's time
        except Exception as e:  # noqa: BLE001 - handed to the waiting request
            _settle(job.future, exception=e)
            return
        budget = threading.Timer(self.compile_seconds, self._expire, (job.future,))
        budget.daemon = True
        budget.start()
        try:
            compiled = self._compile(job.grammar)
        except Exception as e:  # noqa: BLE001 - handed to the waiting request
            _settle(job.future, exception=e)
        else:
            _settle(job.future, result=compiled)  # dropped if the budget ran out first
        finally:
            budget.cancel()

    def _expire(self, future: Future) -> None:
        _settle(
            future,
            exception=GrammarTooCostly(
                f"{TOO_COSTLY} {self.compile_seconds:g} s to compile, the most one request may "
                "take (grammar_compile_seconds): use a smaller schema or fewer tools (fewer or "
                "shorter enum values, fewer properties)"
            ),
        )

    def _compiler_ready(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                info = _tokenizer_info(self._tokenizer, self.vocab_size, self._stop_token_ids)
                threads = max(1, min(8, (os.cpu_count() or 2) // 2))
                # Thread-safe: lanes compile on it at once.
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return self._compiler

    def _compile(self, grammar: str) -> xgr.CompiledGrammar:
        return self._compiler_ready().compile_grammar(grammar)

    def start(
        self, request_id: str, compiled: xgr.CompiledGrammar, starts_after: int | None = None
    ) -> None:
        """The request's grammar applies from its first token, or from the token after its
        first `starts_after`."""
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(compiled)
        if starts_after is not None:
            self._waiting[request_id] = starts_after

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._waiting.pop(request_id, None)

    def apply_masks(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Set to -inf, in place, every logit a row's grammar forbids next (one batched call)."""
        rows = [
            i
            for i, request in enumerate(requests)
            if request.request_id in self._matchers and request.request_id not in self._waiting
        ]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(requests), self.vocab_size)
        for i in rows:
            self._matchers[requests[i].request_id].fill_next_token_bitmask(bitmask, i)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's grammar past its sampled token. True once the grammar has ended:
        a stop token was accepted, or nothing but one may follow (so the engine need not spend a
        step sampling it). Unconstrained requests never end here, nor do those whose grammar
        waits: the token it waits for starts it, with the next token."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        awaited = self._waiting.get(request_id)
        if awaited is not None:
            if token == awaited:
                del self._waiting[request_id]
            return False
        if not matcher.accept_token(token):
            raise GrammarViolation(f"token {token} does not follow the request's grammar")
        if matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        # Complete, yet it may go on (more digits, more text): ended only if it cannot.
        matcher.fill_next_token_bitmask(self._scratch)
        return not (self._scratch.numpy().view(np.uint32) & self._non_stop).any()


def _settle(future: Future, result: Any = None, exception: BaseException | None = None) -> None:
    """Finish `future` unless it has finished already (a compile and its budget race)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def _tokenizer_info(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]
) -> xgr.TokenizerInfo:
    import xgrammar as xgr

    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    # xgrammar reads an added special token such as <|im_start|> as its text, and would let it
    # into a JSON string; spelled as nothing, a token counts as special and is never allowed.
    vocab = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            vocab[i] = token
    special = set(tokenizer.all_special_ids)
    special.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    for i in special:
        if i < vocab_size:
            vocab[i] = ""
    return xgr.TokenizerInfo(
        vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )

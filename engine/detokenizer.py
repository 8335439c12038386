"""A request's output text, decoded as its tokens arrive, and the stop strings found in it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pagedbatch.engine.sampling_params import SamplingParams

# What a lossy UTF-8 decode puts where a character's bytes have not all arrived yet.
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class _Vocabulary:
    """What incremental decoding needs to know about a tokenizer; found once per tokenizer."""

    decode: Callable[..., str]  # (ids, skip_special_tokens=...) -> text
    special_ids: frozenset[int]  # the tokens that decoding with skip_special_tokens drops
    # The `<0xNN>` tokens of a byte-fallback BPE (Llama 2, Mistral). Its decoder turns a whole run
    # of them into U+FFFDs when the run is not valid UTF-8, valid leading bytes included, so a
    # run's text is final only once a token of another kind follows.
    byte_ids: frozenset[int]


@functools.lru_cache(maxsize=8)
def _vocabulary(tokenizer: PreTrainedTokenizerBase) -> _Vocabulary:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return _Vocabulary(tokenizer.decode, frozenset(), frozenset())
    added = backend.get_added_tokens_decoder()
    special_ids = frozenset(i for i, token in added.items() if token.special)
    byte_ids: frozenset[int] = frozenset()
    if getattr(backend.model, "byte_fallback", False):
        ids = (backend.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
        byte_ids = frozenset(i for i in ids if i is not None)
    # The Rust tokenizer itself costs a fifth of the transformers wrapper per call and gives the
    # same text: the wrapper only adds clean-up, which defaults off (and is skipped for BPE).
    return _Vocabulary(backend.decode, special_ids, byte_ids)


class IncrementalDetokenizer:
    """Decodes one completion token by token and stops it at the first stop string.

    Decoding works on a short window of tokens, never the whole output: the window starts at the
    tokens of the previous emission (context for decoders whose output depends on neighbours) and
    new text is what decoding the window adds to decoding that context alone. Tokens that end in
    an incomplete UTF-8 character (or a run of byte-fallback tokens) wait in the window until it
    completes, or until the last update. The text equals `tokenizer.decode(output_ids,
    skip_special_tokens=...)`, cut at the stop string.

    Stop strings are searched only where one could have been completed by the new text, once the
    output has min_tokens tokens, and the first stop string to be completed wins (on a tie, the
    longer one): the text a character stream would have produced. `stable_text` holds back a tail
    that could still grow into a stop string. Both come from one matcher per stop string that reads
    each new character once, so an update costs the same however long the text has grown.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> None:
        vocabulary = _vocabulary(tokenizer)
        self._decode_ids = vocabulary.decode
        self._skip_special = params.skip_special_tokens
        # Skipped tokens are dropped on arrival, so they neither widen the window nor split a run
        # of byte tokens that the decoder joins.
        self._skipped = vocabulary.special_ids if params.skip_special_tokens else frozenset()
        self._byte_ids = vocabulary.byte_ids
        self._stops = [_StopMatcher(stop) for stop in params.stop]
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self._include_stop = params.include_stop_str_in_output
        self._window: list[int] = []
        self._read = 0  # window[:_read] is already in the text
        self._read_text = ""  # the decode of window[:_read]
        self._text = ""
        self._stable_len = 0
        self.stop_string: str | None = None
        self.finished = False

    @property
    def output_text(self) -> str:
        """Everything decoded so far, cut before (or after) a matched stop string."""
        return self._text

    @property
    def stable_text(self) -> str:
        """The prefix of the output text that no later token can change; all of it once finished.
        It only grows."""
        return self._text[: self._stable_len]

    @property
    def num_stable_chars(self) -> int:
        """The length of `stable_text`, without copying it."""
        return self._stable_len

    def stable_text_from(self, start: int) -> str:
        """`stable_text[start:]`, copying only that: what is new since a reader's last look."""
        return self._text[start : self._stable_len]

    def update(self, token_ids: list[int], final: bool = False) -> str | None:
        """Add newly generated tokens and return the stop string they completed, if any.

        `final` says no token will follow: an incomplete character at the end is then decoded as
        the tokenizer would (U+FFFD) and the held-back text is released. A matched stop string
        finishes the detokenizer too; the caller must not add tokens after that.
        """
        if self.finished:
            raise RuntimeError("the detokenizer is finished; it takes no more tokens")
        self.finished = final
        start = len(self._text)
        self._num_tokens += len(token_ids)
        self._window.extend(token for token in token_ids if token not in self._skipped)
        text = self._decode(self._window)
        if len(text) > len(self._read_text) and (final or self._settled(text)):
            self._text += text[len(self._read_text) :]
            self._window = self._window[self._read :]
            self._read = len(self._window)
            self._read_text = self._decode(self._window)
        stop = self._find_stop(start)
        self._stable_len = len(self._text) if self.finished else len(self._text) - self._held()
        return stop

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self._skip_special)

    def _settled(self, text: str) -> bool:
        """Whether the window's text can no longer change as tokens follow."""
        return not text.endswith(_REPLACEMENT) and self._window[-1] not in self._byte_ids

    def _find_stop(self, start: int) -> str | None:
        """Read the text from `start` on; the first stop string it completes ends the output."""
        # Like vLLM, a stop string completed before min_tokens tokens does not count, ever.
        counts = self._num_tokens >= self._min_tokens
        best: tuple[int, int, str] | None = None  # (end, begin, stop): the earliest end wins
        for matcher in self._stops:
            end = matcher.read(self._text, start, stop_at_match=counts)
            if end is not None and counts:
                stop = matcher.stop
                candidate = (end, end - len(stop), stop)
                best = candidate if best is None else min(best, candidate)
        if best is None:
            return None
        end, begin, stop = best
        self._text = self._text[: end if self._include_stop else begin]
        self.stop_string = stop
        self.finished = True
        return stop

    def _held(self) -> int:
        """The length of the longest tail of the text that is a proper prefix of a stop string."""
        return max((matcher.matched for matcher in self._stops), default=0)


class _StopMatcher:
    """Knuth-Morris-Pratt search for one stop string in a text that grows at its end.

    `matched` is the length of the longest tail of the text read so far that is a proper prefix of
    the stop string. Each character read moves it in amortised constant time, so reading costs
    what was appended, not the length of the text or of the stop string.
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.matched = 0
        # border[i]: the length of the longest proper prefix of stop[: i + 1] that is also its
        # suffix, where a failed match falls back to.
        self._border = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._border[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._border[i] = k

    def read(self, text: str, start: int, stop_at_match: bool) -> int | None:
        """Read text[start:]; the end of the first match in it, or None. With `stop_at_match`
        reading stops there (the text is cut and read no further); otherwise it goes on."""
        stop, border, matched = self.stop, self._border, self.matched
        first_end = None
        i = start
        while i < len(text):
            if not matched:
                # Nothing pending: skip straight to the next possible start, at C speed.
                i = text.find(stop[0], i)
                if i < 0:
                    break
            char = text[i]
            while matched and stop[matched] != char:
                matched = border[matched - 1]
            if stop[matched] == char:
                matched += 1
            i += 1
            if matched == len(stop):
                matched = border[matched - 1]  # the match's own tail may begin the next one
                if first_end is None:
                    first_end = i
                if stop_at_match:
                    break
        self.matched = matched
        return first_end

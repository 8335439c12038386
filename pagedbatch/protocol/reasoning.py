"""A reasoning model's answer split into its thinking and its content.

Reasoning models (DeepSeek-R1, Qwen3) think between `<think>` and `</think>`, then answer. Chat
returns the thinking as `reasoning_content` and the rest as `content`, as vLLM's reasoning
parsers do. Where the thinking starts is the chat template's: R1's templates end the prompt with
`<think>`, so the output starts inside it; Qwen3's leave the model to open it (or, with thinking
switched off, write an empty `<think></think>` into the prompt). So the prompt decides: an output
that starts inside the thinking is thinking up to `</think>`; any other is thinking only if it
opens with `<think>`. An unclosed thinking (an output cut by `max_tokens`) is all thinking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

# OpenAI's reasoning efforts; `none` asks for no thinking at all.
NO_THINKING = "none"


@dataclass(frozen=True)
class Split:
    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningSplitter:
    """Splits the outputs of one request, whose prompt `starts_inside` the thinking or not.

    The split of a longer text extends the split of any prefix of it that `settled` returns:
    what a stream has sent as reasoning or content never has to be taken back.
    """

    start: str
    end: str
    end_token_id: int
    starts_inside: bool
    start_token_id: int | None = None

    @classmethod
    def for_prompt(
        cls, tags: tuple[str, str] | None, prompt: str, tokenizer: PreTrainedTokenizerBase
    ) -> ReasoningSplitter | None:
        """The splitter for outputs of `prompt` (the rendered chat), or None for a model that
        does not reason (`tags` None)."""
        if tags is None:
            return None
        start, end = tags
        inside = prompt.rstrip().endswith(start)
        ids = tokenizer.convert_tokens_to_ids([end, start])
        return cls(start, end, ids[0], starts_inside=inside, start_token_id=ids[1])

    def grammar_starts_after(self, prompt_token_ids: Sequence[int]) -> int | None:
        """The token after which a structured output's grammar applies (vLLM's
        `reasoning_ended`): the end of the thinking, so that the thinking is free and the answer
        obeys; None (from the first token) where the prompt has closed the thinking already,
        its last tag the closing one (a template whose thinking is switched off writes an
        empty one)."""
        for token in reversed(prompt_token_ids):
            if token == self.end_token_id:
                return None
            if token == self.start_token_id:
                break
        return self.end_token_id

    def split(self, text: str) -> Split:
        """The whole output `text` as reasoning and content; either None where it has none."""
        if not self.starts_inside:
            opened = text.lstrip()
            if not opened.startswith(self.start):
                return Split(None, text)
            text = opened[len(self.start) :]
        reasoning, closed, content = text.partition(self.end)
        return Split(reasoning, content or None) if closed else Split(text, None)

    def settled(self, text: str) -> str:
        """The longest prefix of a growing output whose split cannot change as it grows: without
        a tail that may be the start of a tag, and empty while an output that may still open its
        thinking has said nothing else."""
        if not self.starts_inside and self.start.startswith(text.lstrip()):
            return ""
        for tag in (self.end, self.start):
            for length in range(min(len(tag) - 1, len(text)), 0, -1):
                if text.endswith(tag[:length]):
                    return text[:-length]
        return text

    def reasoning_tokens(self, token_ids: Sequence[int], split: Split) -> int:
        """How many of an output's tokens are its thinking, `</think>` included (OpenAI counts
        `reasoning_tokens` within `completion_tokens`)."""
        if split.reasoning is None:
            return 0
        ids = list(token_ids)
        return ids.index(self.end_token_id) + 1 if self.end_token_id in ids else len(ids)


@dataclass
class ReasoningStream:
    """One streamed choice: its text so far, and how much of its split has been sent."""

    splitter: ReasoningSplitter
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    sent_reasoning: int = 0
    sent_content: int = 0

    def feed(self, text: str, token_ids: Sequence[int], finished: bool) -> Split:
        """What the choice's reasoning and content gained with `text` (its tokens
        `token_ids`); all of it once `finished`."""
        self.text += text
        self.token_ids.extend(token_ids)
        split = self.splitter.split(self.text if finished else self.splitter.settled(self.text))
        reasoning = (split.reasoning or "")[self.sent_reasoning :]
        content = (split.content or "")[self.sent_content :]
        self.sent_reasoning += len(reasoning)
        self.sent_content += len(content)
        return Split(reasoning or None, content or None)

    def reasoning_tokens(self) -> int:
        split = self.splitter.split(self.text)
        return self.splitter.reasoning_tokens(self.token_ids, split)

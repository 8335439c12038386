"""How a moderation model reads a text and says its category scores.

Two kinds, told apart by config.json:

- a sequence classifier (`*ForSequenceClassification`, its labels OpenAI's categories): the text's
  tokens in, the score head's logits at the last token out (`SamplingParams.scores`); a
  category's score is the sigmoid of its label's logit, as transformers reads a multi-label head;
- a generative guard (Llama Guard style: a causal LM whose chat template renders the
  conversation and the hazard categories): its score is the probability of "unsafe" as the
  first token it writes (the softmax of that position's raw logits), and its categories are the
  codes it writes on the second line, decoded under a grammar that allows only the codes; the
  output is made to begin "unsafe" so that the codes are there to read whatever the verdict,
  while the probability is read before that constraint. Each code's OpenAI category gets the
  score; the others get 0.

A text longer than the model's context is read in windows of it, each scored on its own; the
text's score in a category is the highest of its windows'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch

from pagedbatch.engine.outputs import CompletionOutput
from pagedbatch.engine.sample.structured_output import StructuredOutput
from pagedbatch.engine.sampling_params import SamplingParams
from pagedbatch.moderation import CATEGORIES, GUARD_CODES
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.serving.common import ServedModel

UNSAFE = "unsafe"
# "unsafe", a line break, then at least one code: what a guard writes of unsafe content.
_CODES = " | ".join(f'"{code}"' for code in GUARD_CODES)
CODES_GRAMMAR = f'root ::= "{UNSAFE}\\n" code ("," code)*\ncode ::= {_CODES}\n'
MAX_CODE_TOKENS = 64  # room for every code, whatever the tokenizer makes of them


def category_scores(labels: list[str], logits: torch.Tensor) -> dict[str, float]:
    """Every OpenAI category's score from a classifier's label logits: their sigmoid; a category
    the classifier does not score is 0, never flagged."""
    scores = dict(zip(labels, logits.sigmoid().tolist(), strict=True))
    return {category: scores.get(category, 0.0) for category in CATEGORIES}


# What a classifier is asked: its scores at the prompt's last token, nothing generated after.
CLASSIFY = SamplingParams(max_tokens=1, temperature=0.0, scores=True)


@functools.cache
def _guard_params() -> SamplingParams:
    """What a generative guard is asked: its verdict's logits, then the codes under the grammar
    (built, and the grammar checked, once)."""
    return SamplingParams(
        max_tokens=MAX_CODE_TOKENS,
        temperature=0.0,
        scores=True,
        structured=StructuredOutput(CODES_GRAMMAR),
    )


@dataclass(frozen=True)
class Classifier:
    served: ServedModel
    params: ClassVar[SamplingParams] = CLASSIFY

    def prompts(self, text: str) -> list[list[int]]:
        tokens = self.served.tokenizer.encode(text)
        window = self.served.max_model_len - 1  # the scored position is the window's last
        return [tokens[start : start + window] for start in range(0, len(tokens), window)]

    def scores(self, output: CompletionOutput) -> dict[str, float]:
        return category_scores(self.served.labels, output.scores)


@dataclass(frozen=True)
class GenerativeGuard:
    served: ServedModel

    @property
    def params(self) -> SamplingParams:
        return _guard_params()

    @cached_property
    def unsafe_token(self) -> int:
        return self.served.tokenizer.encode(UNSAFE, add_special_tokens=False)[0]

    @cached_property
    def room(self) -> int:
        """The text tokens a prompt holds beside the template and the codes."""
        return self.served.max_model_len - len(self.render("")) - MAX_CODE_TOKENS

    def render(self, text: str) -> list[int]:
        """The guard's prompt for a user message of `text`."""
        conversation = [{"role": "user", "content": text}]
        rendered = self.served.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        return self.served.tokenizer.encode(rendered, add_special_tokens=False)

    def prompts(self, text: str) -> list[list[int]]:
        tokenizer = self.served.tokenizer
        room = self.room
        if room < 1:
            raise OpenAIError(
                "The moderation model's context holds no text beside its template.",
                status_code=500,
                type="server_error",
            )
        tokens = tokenizer.encode(text, add_special_tokens=False)
        windows = [tokens[start : start + room] for start in range(0, len(tokens), room)]
        return [self.render(tokenizer.decode(window)) for window in windows or [[]]]

    def scores(self, output: CompletionOutput) -> dict[str, float]:
        unsafe = output.scores.softmax(-1)[self.unsafe_token].item()
        codes = output.text.partition("\n")[2].split(",")
        flagged = {GUARD_CODES[code][1] for code in codes if code in GUARD_CODES}
        return {category: unsafe if category in flagged else 0.0 for category in CATEGORIES}


Guard = Classifier | GenerativeGuard


def guard_of(served: ServedModel) -> Guard:
    """How `served`, a moderation model, is read."""
    return Classifier(served) if served.labels is not None else GenerativeGuard(served)


def highest(scores: list[dict[str, float]]) -> dict[str, float]:
    """Per category, the highest of a text's windows' scores."""
    return {category: max(s[category] for s in scores) for category in CATEGORIES}

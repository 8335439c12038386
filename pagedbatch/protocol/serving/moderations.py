"""Moderation on a sequence classifier guard: each input's text becomes one engine request that
asks for its scores (the score head's logits at the last token, `SamplingParams.scores`); a
category's score is the sigmoid of its label's logit, as transformers' multi-label classifiers
read them, and an input is flagged where any score reaches the threshold.

OpenAI's moderation model names (`omni-moderation-latest` and the like) name the served guard,
so that clients written for OpenAI run unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.engine.sampling_params import SamplingParams
from pagedbatch.ids import new_id
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.moderation import CATEGORIES
from pagedbatch.protocol.schemas.moderations import (
    Moderation,
    ModerationCreateResponse,
    ModerationRequest,
)
from pagedbatch.protocol.serving.common import (
    EngineInput,
    ServedModel,
    check_context_length,
    model_not_found,
)

OPENAI_MODELS = frozenset(
    {
        "omni-moderation-latest",
        "omni-moderation-2024-09-26",
        "text-moderation-latest",
        "text-moderation-stable",
        "text-moderation-007",
    }
)
SCORES = SamplingParams(max_tokens=1, temperature=0.0, scores=True)


@dataclass
class PreparedModeration:
    id: str
    model: str
    labels: list[str]
    threshold: float
    inputs: list[EngineInput]

    def input_texts(self) -> list[str]:
        return []  # what is moderated is not filtered

    def response(self, outputs: list[RequestOutput]) -> ModerationCreateResponse:
        return ModerationCreateResponse(
            id=self.id,
            model=self.model,
            results=[self._result(output) for output in outputs],
        )

    def _result(self, output: RequestOutput) -> Moderation:
        scores = category_scores(self.labels, output.outputs[0].scores)
        categories = {c: score >= self.threshold for c, score in scores.items()}
        return Moderation(
            flagged=any(categories.values()),
            categories=categories,
            category_scores=scores,
            category_applied_input_types={c: ["text"] for c in CATEGORIES},
        )


def category_scores(labels: list[str], logits: torch.Tensor) -> dict[str, float]:
    """Every OpenAI category's score from a classifier's label logits: their sigmoid; a category
    the classifier does not score is 0, never flagged."""
    scores = dict(zip(labels, logits.sigmoid().tolist(), strict=True))
    return {category: scores.get(category, 0.0) for category in CATEGORIES}


def guard_model(requested: str | None, guard: ServedModel) -> str:
    """The served guard's name, if `requested` names it (or OpenAI's moderation models, or none);
    else a 404."""
    if requested is None or requested == guard.model_name or requested in OPENAI_MODELS:
        return guard.model_name
    raise model_not_found(requested)


def prepare_moderation(
    request: ModerationRequest, guard: ServedModel, threshold: float, max_inputs: int
) -> PreparedModeration:
    """One engine request per input; OpenAIError for what the guard cannot score."""
    model = guard_model(request.model, guard)
    labels = guard.labels
    if labels is None:
        raise OpenAIError(
            f"The model `{model}` is not a classifier and cannot score content.", param="model"
        )
    texts = _texts(request, max_inputs)
    id_ = new_id("modr-")
    inputs = []
    for i, text in enumerate(texts):
        prompt = guard.tokenizer.encode(text)
        param = "input" if isinstance(request.input, str) else f"input[{i}]"
        check_context_length(len(prompt), 1, guard, param=param)
        inputs.append(EngineInput(f"{id_}-{i}", prompt, SCORES))
    return PreparedModeration(id_, model, labels, threshold, inputs)


def _texts(request: ModerationRequest, max_inputs: int) -> list[str]:
    """The texts to score: the string, each string of a list, or a list of parts as one."""
    given = request.input
    if isinstance(given, str):
        texts = [given]
    elif isinstance(given[0], str):
        texts = list(given)
    else:
        if images := [i for i, part in enumerate(given) if part.type == "image_url"]:
            raise OpenAIError(
                "This moderation model reads text only; remove the image parts.",
                param=f"input[{images[0]}]",
                code="unsupported_input",
            )
        texts = ["\n".join(part.text for part in given)]
    if len(texts) > max_inputs:
        raise OpenAIError(
            f"A moderation request holds at most {max_inputs} inputs; this one has {len(texts)}.",
            param="input",
        )
    if empty := [i for i, text in enumerate(texts) if not text.strip()]:
        param = "input" if isinstance(given, str) else f"input[{empty[0]}]"
        raise OpenAIError("An input to moderate must hold some text.", param=param)
    return texts

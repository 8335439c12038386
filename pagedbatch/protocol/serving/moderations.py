"""Moderation on the served moderation model (a classifier or a generative guard, see
guards.py): each input's text becomes one engine request per window of the model's context, and
an input is flagged where any category's score reaches the threshold.

OpenAI's moderation model names (`omni-moderation-latest` and the like) name the served model,
so that clients written for OpenAI run unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.ids import new_id
from pagedbatch.moderation import CATEGORIES
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.moderations import (
    Moderation,
    ModerationCreateResponse,
    ModerationRequest,
)
from pagedbatch.protocol.serving.common import EngineInput, ServedModel, model_not_found
from pagedbatch.protocol.serving.guards import Guard, guard_of, highest

OPENAI_MODELS = frozenset(
    {
        "omni-moderation-latest",
        "omni-moderation-2024-09-26",
        "text-moderation-latest",
        "text-moderation-stable",
        "text-moderation-007",
    }
)


@dataclass
class PreparedModeration:
    id: str
    model: str
    guard: Guard
    threshold: float
    inputs: list[EngineInput]
    windows: list[int]  # engine requests of each input, in order

    def input_texts(self) -> list[str]:
        return []  # what is moderated is not filtered

    def response(self, outputs: list[RequestOutput]) -> ModerationCreateResponse:
        results, start = [], 0
        for count in self.windows:
            scores = [self.guard.scores(o.outputs[0]) for o in outputs[start : start + count]]
            results.append(self._result(highest(scores)))
            start += count
        return ModerationCreateResponse(id=self.id, model=self.model, results=results)

    def _result(self, scores: dict[str, float]) -> Moderation:
        categories = {c: score >= self.threshold for c, score in scores.items()}
        return Moderation(
            flagged=any(categories.values()),
            categories=categories,
            category_scores=scores,
            category_applied_input_types={c: ["text"] for c in CATEGORIES},
        )


def guard_model(requested: str | None, guard: ServedModel) -> str:
    """The served guard's name, if `requested` names it (or OpenAI's moderation models, or none);
    else a 404."""
    if requested is None or requested == guard.model_name or requested in OPENAI_MODELS:
        return guard.model_name
    raise model_not_found(requested)


def prepare_moderation(
    request: ModerationRequest, served: ServedModel, threshold: float, max_inputs: int
) -> PreparedModeration:
    """Engine requests for each input's windows; OpenAIError for what cannot be scored."""
    model = guard_model(request.model, served)
    guard = guard_of(served)
    id_ = new_id("modr-")
    inputs, windows = [], []
    for text in _texts(request, max_inputs):
        prompts = guard.prompts(text)
        windows.append(len(prompts))
        inputs.extend(
            EngineInput(f"{id_}-{len(inputs) + i}", prompt, guard.params)
            for i, prompt in enumerate(prompts)
        )
    return PreparedModeration(id_, model, guard, threshold, inputs, windows)


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

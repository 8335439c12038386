"""Content filtering on the doors: each tenant's policy, its blocklist, and screening text with
the moderation model.

A policy says which way content is checked (`off`, `input`, `output` or `both`), from what score
each category counts as flagged, and which literal strings or regular expressions refuse a text
before any model reads it. The service's settings give the default; `safety_tenants` overrides
any part of it for one tenant (an API key's id), and for that tenant only.

Screening scores a text exactly as `/v1/moderations` does (protocol/serving/guards.py), a text
longer than the moderation model's context in windows of it, flagged if any window is: length
is no way past the filter. Decisions are logged with the request id and
counted by door, direction and category, never with the text.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from prometheus_client import Counter

from pagedbatch.engine.outputs import CompletionOutput, RequestOutput
from pagedbatch.ids import new_id
from pagedbatch.moderation import CATEGORIES, Checks, TenantSafety
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.serving.guards import guard_of

if TYPE_CHECKING:
    from pagedbatch.engine import AsyncLLM
    from pagedbatch.settings import Settings

logger = logging.getLogger(__name__)

BLOCKLIST = "blocklist"  # the category a blocklist match is counted and reported under

CONTENT_FILTERED = Counter(
    "pagedbatch:content_filter_decisions",
    "Texts the content filter refused, by door (realtime or batch), direction (input or "
    "output) and category (or blocklist).",
    ["door", "direction", "category"],
)


@dataclass(frozen=True)
class SafetyPolicy:
    checks: Checks = "off"
    threshold: float = 0.5
    categories: Mapping[str, float] = field(default_factory=dict)  # per-category thresholds
    blocklist: tuple[re.Pattern[str], ...] = ()

    @property
    def screens_input(self) -> bool:
        return self.checks in ("input", "both")

    @property
    def screens_output(self) -> bool:
        return self.checks in ("output", "both")

    def flagged(self, scores: Mapping[str, float]) -> list[str]:
        """The categories whose score reaches their threshold."""
        return [c for c, score in scores.items() if score >= self.categories.get(c, self.threshold)]

    def blocked(self, text: str) -> bool:
        return any(pattern.search(text) for pattern in self.blocklist)


def policy_for(settings: Settings, tenant: str) -> SafetyPolicy:
    """The policy in force for `tenant`: the service's, with the tenant's overrides."""
    own = settings.safety_tenants.get(tenant) or TenantSafety()
    blocklist = own.blocklist if own.blocklist is not None else settings.safety_blocklist
    return SafetyPolicy(
        checks=own.policy or settings.safety_policy,
        threshold=own.threshold if own.threshold is not None else settings.safety_threshold,
        categories={**settings.safety_category_thresholds, **own.categories},
        blocklist=_compiled(tuple(blocklist)),
    )


@functools.lru_cache(maxsize=256)
def _compiled(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    """A blocklist's patterns, compiled once: a policy is made for every request."""
    return tuple(re.compile(pattern) for pattern in patterns)


@dataclass(frozen=True)
class Verdict:
    """What screening found: the flagged categories (BLOCKLIST for a blocklist match)."""

    categories: tuple[str, ...] = ()

    @property
    def flagged(self) -> bool:
        return bool(self.categories)


async def screen(
    guard: AsyncLLM | None,
    texts: Sequence[str],
    policy: SafetyPolicy,
    *,
    priority: int,
    cache_salt: str | None = None,
) -> Verdict:
    """Screen `texts` against `policy`: the blocklist first, then the moderation model (each text,
    in windows of its context, all at once). Without a moderation model only the blocklist
    applies."""
    if any(policy.blocked(text) for text in texts):
        return Verdict((BLOCKLIST,))
    if guard is None:
        return Verdict()
    reader = guard_of(guard.engine)

    def windows() -> list[list[int]]:
        return [prompt for text in texts for prompt in reader.prompts(text) if prompt]

    async def score(prompt: list[int]) -> dict[str, float]:
        final = None
        async for output in guard.generate(
            prompt,
            reader.params,
            request_id=new_id("screen-"),
            priority=priority,
            final_only=True,
            cache_salt=cache_salt,
        ):
            final = output
        return reader.scores(final.outputs[0])

    # Tokenizing a long prompt takes long enough to stall the event loop.
    prompts = await asyncio.to_thread(windows)
    flagged: set[str] = set()
    for scores in await asyncio.gather(*(score(p) for p in prompts)):
        flagged.update(policy.flagged(scores))
    return Verdict(tuple(c for c in CATEGORIES if c in flagged))


class OutputScreen:
    """Screens what one request generates, as it comes: each completion's text is held back until
    the text so far has been screened, once `every` tokens have come since the last check and at
    its end, so no text goes out that was not. (The engine's pieces are folded together while a
    screen runs, so a check may fall a few tokens past the `every`-th: where a flagged output
    stops can differ between two runs of one request; what goes out is always screened.)
    Flagged, the request stops: every completion still running ends with finish_reason
    "content_filter" and a refusal naming the categories, its unscreened text dropped (its
    tokens still counted), and closing the outputs' source aborts the engine requests.

    It wraps a source that yields, whenever the request moves, one output per engine request
    (None if that one did not move): DELTA pieces of a stream, or one FINAL_ONLY output each.
    """

    def __init__(
        self,
        guard: AsyncLLM | None,
        policy: SafetyPolicy,
        every: int,
        choices: Sequence[int],
        *,
        priority: int,
        cache_salt: str | None,
        door: str,
        request_id: str | None,
    ) -> None:
        self.guard = guard
        self.policy = policy
        self.every = every
        self.choices = choices  # completions of each engine request (its n)
        self.priority = priority
        self.cache_salt = cache_salt
        self.door = door
        self.request_id = request_id

    async def screened(
        self, running: AsyncGenerator[list[RequestOutput | None], None]
    ) -> AsyncGenerator[list[RequestOutput | None], None]:
        held: list[RequestOutput | None] = [None] * len(self.choices)
        seen: list[RequestOutput | None] = [None] * len(self.choices)
        released: dict[tuple[int, int], str] = {}  # (engine request, completion) -> text out
        ended: set[tuple[int, int]] = set()
        async with contextlib.aclosing(running):
            async for outputs in running:
                for i, new in enumerate(outputs):
                    if new is not None:
                        seen[i] = new
                        if held[i] is None:
                            held[i] = new
                        else:
                            held[i].add(new)
                due = [
                    i for i, output in enumerate(held) if output is not None and self._due(output)
                ]
                if not due:
                    continue
                texts = [
                    released.get((i, c.index), "") + c.text for i in due for c in held[i].outputs
                ]
                verdict = await screen(
                    self.guard,
                    texts,
                    self.policy,
                    priority=self.priority,
                    cache_salt=self.cache_salt,
                )
                if verdict.flagged:
                    record(verdict, door=self.door, direction="output", request_id=self.request_id)
                    yield [
                        self._stopped(i, held[i], seen[i], ended, verdict) for i in range(len(held))
                    ]
                    return
                out: list[RequestOutput | None] = [None] * len(held)
                for i in due:
                    output, held[i] = held[i], None
                    for c in output.outputs:
                        released[(i, c.index)] = released.get((i, c.index), "") + c.text
                        if c.finished:
                            ended.add((i, c.index))
                    out[i] = output
                yield out

    async def screened_final(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Finished outputs, screened: as they were, or stopped by the filter."""

        async def once() -> AsyncGenerator[list[RequestOutput | None], None]:
            yield list(outputs)

        final: list[RequestOutput] = []
        async for screened in self.screened(once()):
            final = [s if s is not None else o for s, o in zip(screened, outputs, strict=True)]
        return final

    def _due(self, output: RequestOutput) -> bool:
        return any(c.finished or len(c.token_ids) >= self.every for c in output.outputs)

    def _stopped(
        self,
        position: int,
        held: RequestOutput | None,
        seen: RequestOutput | None,
        ended: set[tuple[int, int]],
        verdict: Verdict,
    ) -> RequestOutput:
        """The engine request's last output: each completion not yet ended stops, its held text
        dropped."""
        refusal = (
            "The response was stopped by the content filter: it was flagged for "
            f"{', '.join(verdict.categories)}."
        )
        tokens = {c.index: c.token_ids for c in held.outputs} if held is not None else {}
        template = seen or RequestOutput(request_id="", prompt_token_ids=[], outputs=[])
        return replace(
            template,
            outputs=[
                CompletionOutput(
                    index=k,
                    token_ids=list(tokens.get(k, [])),
                    finish_reason="content_filter",
                    refusal=refusal,
                )
                for k in range(self.choices[position])
                if (position, k) not in ended
            ],
            finished=True,
        )


def record(verdict: Verdict, *, door: str, direction: str, request_id: str | None) -> None:
    """Log and count a refusal, without the text."""
    if not verdict.flagged:
        return
    logger.warning(
        "content filter: %s %s of request %s flagged for %s",
        door,
        direction,
        request_id,
        ", ".join(verdict.categories),
    )
    for category in verdict.categories:
        CONTENT_FILTERED.labels(door, direction, category).inc()


async def check_prompt(
    guard: AsyncLLM | None,
    texts: Sequence[str],
    policy: SafetyPolicy,
    *,
    door: str,
    priority: int,
    cache_salt: str | None,
    request_id: str | None,
) -> None:
    """Screen what a request's users wrote; flagged, the refusal is recorded and the request is
    a 400 `content_filter` naming the categories."""
    verdict = await screen(guard, texts, policy, priority=priority, cache_salt=cache_salt)
    record(verdict, door=door, direction="input", request_id=request_id)
    if verdict.flagged:
        raise _prompt_refused(verdict)


def _prompt_refused(verdict: Verdict) -> OpenAIError:
    """The 400 of a prompt the content filter flagged, naming the categories."""
    return OpenAIError(
        "The prompt was refused by the content filter: it was flagged for "
        f"{', '.join(verdict.categories)}.",
        param="prompt",
        code="content_filter",
    )

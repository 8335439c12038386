"""One request's way through the engine, the same at every door: its prompt screened by the
content filter, its engine requests run, its output screened, an engine's refusal made an OpenAI
error, and its usage counted from the engine's outputs. The moderation engine's requests are
scores, not text a user reads: nothing of theirs is screened, and they are free. Nor is the output
of a request that generates nothing (embeddings: no one reads what it produces) screened; its
`input_texts` say what of its input is.

The doors keep only what is theirs: the realtime door admission, the spend account, streaming
and a client that leaves; a batch shard its lease, spend reservations, stopping and result
writes; `run-batch` its offline file loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from itertools import zip_longest
from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel

from pagedbatch.engine import AsyncLLM
from pagedbatch.engine.beam_search import beam_search
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.safety import OutputScreen, SafetyPolicy, check_prompt, policy_for
from pagedbatch.protocol.schemas.common import Usage
from pagedbatch.protocol.serving.common import (
    BATCH_PRIORITY,
    REALTIME_PRIORITY,
    EngineInput,
    Prepared,
    prefix_cache_salt,
    usage,
)
from pagedbatch.settings import Settings

Door = Literal["realtime", "batch"]
# What a request yields whenever it moves: one output per engine request, None if that one did
# not move since the last yield.
Outputs = list[RequestOutput | None]
T = TypeVar("T")


@dataclass(frozen=True)
class RequestContext:
    """Whose request it is and how it runs, as its door knows it."""

    door: Door
    priority: int  # REALTIME_PRIORITY or BATCH_PRIORITY
    request_id: str | None  # what the content filter's log lines name
    cache_salt: str | None  # prefix_cache_salt of the request's tenant
    policy: SafetyPolicy
    guard: AsyncLLM | None  # the moderation engine that screens; None: the blocklist alone
    output_check_tokens: int  # tokens generated between two screens of the output
    moderation: bool = False  # the request runs on the moderation engine: nothing screened

    @classmethod
    def of(
        cls,
        settings: Settings,
        tenant: str,
        *,
        door: Door,
        guard: AsyncLLM | None,
        moderation: bool,
        request_id: str | None = None,
    ) -> RequestContext:
        """How `tenant`'s request runs at `door`: realtime ahead of batch lines, in the tenant's
        prefix cache (shared among all where the settings say so), under its content filter."""
        return cls(
            door=door,
            priority=REALTIME_PRIORITY if door == "realtime" else BATCH_PRIORITY,
            request_id=request_id,
            cache_salt=prefix_cache_salt(settings.share_prefix_cache_across_tenants, tenant),
            policy=policy_for(settings, tenant),
            guard=guard,
            output_check_tokens=settings.safety_output_check_tokens,
            moderation=moderation,
        )

    @property
    def screens_input(self) -> bool:
        return self.policy.screens_input and not self.moderation

    @property
    def screens_output(self) -> bool:
        return self.policy.screens_output and not self.moderation


class RequestPipeline:
    """The steps of one prepared request on `engine`: `screen_input` first (before admission, or
    before any engine work of a batch line), then `outputs` (or `final_outputs`), then `usage`;
    a batch line takes them all at once (`batch_line`)."""

    def __init__(self, engine: AsyncLLM, prepared: Prepared, context: RequestContext) -> None:
        self.engine = engine
        self.prepared = prepared
        self.context = context

    async def screen_input(self) -> None:
        """A 400 `content_filter` if the content filter flags what the request's users wrote."""
        context = self.context
        if not context.screens_input:
            return
        await check_prompt(
            context.guard,
            self.prepared.input_texts(),
            context.policy,
            door=context.door,
            priority=context.priority,
            cache_salt=context.cache_salt,
            request_id=context.request_id,
        )

    def outputs(
        self, engine_done: Callable[[], None] | None = None
    ) -> AsyncGenerator[Outputs, None]:
        """The request's outputs as they come, screened: whenever it moves, what each engine
        request said since the last yield (DELTA pieces of a stream, else one whole output
        each). Screening the output asks for DELTA pieces, so that flagged output stops the
        request mid-way. Closing it aborts what still runs; `engine_done` runs once the engine
        holds none of its requests."""
        screen = self._output_screen()
        if screen is not None:
            self.prepared.inputs = [_in_pieces(i) for i in self.prepared.inputs]
        running = run(self.engine, self.prepared.inputs, self.context, engine_done)
        return running if screen is None else screen.screened(running)

    async def final_outputs(self, *, screen_at_end: bool = False) -> list[RequestOutput]:
        """Each engine request's whole output, screened. `screen_at_end`: the engine gives
        each its final output alone (FINAL_ONLY) and the output is screened once whole, which
        costs the engine no output building and the guard one look a line (a batch line, whose
        reader waits for the whole anyway); otherwise as `outputs`."""
        if not screen_at_end:
            return await final_outputs(self.outputs())
        self.prepared.inputs = [_final_only(i) for i in self.prepared.inputs]
        whole = await final_outputs(run(self.engine, self.prepared.inputs, self.context))
        screen = self._output_screen()
        return whole if screen is None else await screen.screened_final(whole)

    async def batch_line(self) -> tuple[dict[str, Any], Usage | None]:
        """A batch line's answer, as a shard and run-batch give it: its input screened, its
        engine requests run to their end and their output screened once whole, then the
        response body (JSON) and what it used."""
        await self.screen_input()
        outputs = await self.final_outputs(screen_at_end=True)
        body = cast("BaseModel", self.prepared.response(outputs))  # batch endpoints answer JSON
        return body.model_dump(mode="json"), self.usage(outputs)

    def usage(self, outputs: list[RequestOutput]) -> Usage | None:
        """What the request used, from its engine outputs (whole, not DELTA); None for the
        moderation engine's, which are free."""
        return None if self.context.moderation else usage(outputs)

    def _output_screen(self) -> OutputScreen | None:
        context = self.context
        generates = any(engine_input.generates for engine_input in self.prepared.inputs)
        if not context.screens_output or not generates:
            return None
        return OutputScreen(
            context.guard,
            context.policy,
            context.output_check_tokens,
            [engine_input.params.n for engine_input in self.prepared.inputs],
            priority=context.priority,
            cache_salt=context.cache_salt,
            door=context.door,
            request_id=context.request_id,
        )


async def run(
    engine: AsyncLLM,
    inputs: list[EngineInput],
    context: RequestContext,
    engine_done: Callable[[], None] | None = None,
) -> AsyncGenerator[Outputs, None]:
    """Runs `inputs` at the context's priority and cache salt, and yields, whenever one moves,
    what each said since the previous yield (None if nothing), until all have finished. Closing
    it aborts what still runs. `engine_done` runs once the engine holds none of them, before the
    caller has seen the end. An engine's refusal (a ValueError: its own checks, e.g. the KV cache
    is too small) is an OpenAIError 400.

    Each input's params ask for its outputs: the final one alone (FINAL_ONLY), or the pieces of a
    stream (DELTA). A caller slower than the engine gets the pieces it missed folded into one: it
    holds one output per engine request, never a backlog of them.
    """
    new: Outputs = [None] * len(inputs)
    finished = [False] * len(inputs)
    moved = asyncio.Event()
    failures: list[Exception] = []
    following = len(inputs)

    async def follow(position: int, engine_input: EngineInput) -> None:
        nonlocal following
        try:
            searching = engine_input.beam is not None
            generate = _beams(engine, engine_input) if searching else engine.generate
            async for output in generate(
                engine_input.prompt_token_ids,
                engine_input.params,
                request_id=engine_input.request_id,
                priority=context.priority,
                cache_salt=context.cache_salt,
                media=engine_input.media,
                lora_name=engine_input.lora_name,
                user_priority=engine_input.user_priority,
            ):
                waiting = new[position]
                if waiting is None:
                    new[position] = output
                else:  # only a DELTA request has more than one output
                    waiting.add(output)
                finished[position] = output.finished
                moved.set()
        except ValueError as exc:
            failures.append(OpenAIError(str(exc)))
        except Exception as exc:
            failures.append(exc)
        finally:
            following -= 1
            if not following and engine_done is not None:
                engine_done()
            moved.set()  # a failure must wake the caller too

    followers = [asyncio.create_task(follow(i, x)) for i, x in enumerate(inputs)]
    try:
        while True:
            await moved.wait()
            moved.clear()
            if failures:
                raise failures[0]
            outputs, new[:] = list(new), [None] * len(new)
            yield outputs
            if all(finished):
                return
    finally:
        for follower in followers:
            follower.cancel()  # leaving `generate` early aborts its request
        await asyncio.gather(*followers, return_exceptions=True)


async def final_outputs(running: AsyncGenerator[Outputs, None]) -> list[RequestOutput]:
    """Each request's whole output: its one FINAL_ONLY output, or its DELTA pieces folded."""
    final: Outputs = []
    async with contextlib.aclosing(running):
        async for outputs in running:
            for position, (new, old) in enumerate(zip_longest(outputs, final)):
                if position == len(final):
                    final.append(new)
                elif old is None:
                    final[position] = new
                elif new is not None:
                    old.add(new)
    return cast("list[RequestOutput]", final)  # all there, and finished


async def unless(work: Awaitable[T], stop: Awaitable[object]) -> T | None:
    """What `work` returns, or None if `stop` comes first (a client gone, a batch cancelled),
    which cancels `work`: closing a request's outputs aborts its engine requests."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(stop)
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


def _beams(
    engine: AsyncLLM, engine_input: EngineInput
) -> Callable[..., AsyncIterator[RequestOutput]]:
    """`engine.generate`'s stand-in for a beam search: the same arguments, and one output, the
    beams'."""
    beam = engine_input.beam
    assert beam is not None and isinstance(engine_input.params, SamplingParams)
    top = engine_input.params.logprobs

    def generate(
        prompt: list[int], _params: SamplingParams, *, request_id: str, **options: Any
    ) -> AsyncIterator[RequestOutput]:
        options.pop("media", None)  # none: refused when the request was prepared
        return beam_search(engine, prompt, beam, request_id, top, **options)

    return generate


def _in_pieces(engine_input: EngineInput) -> EngineInput:
    params = replace(engine_input.params, output_kind=RequestOutputKind.DELTA)
    return replace(engine_input, params=params)


def _final_only(engine_input: EngineInput) -> EngineInput:
    params = replace(engine_input.params, output_kind=RequestOutputKind.FINAL_ONLY)
    return replace(engine_input, params=params)

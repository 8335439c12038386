"""Streamed responses: the server-sent events made from the engine's outputs.

The engine hands a stream DELTA outputs: what each choice gained since the last. Its text holds
back an incomplete character, and anything that could still become a stop string, so the chunks
never split a character, never show a stop string, and join into exactly the text that the
non-streamed response holds. Free of any web framework: the realtime door feeds outputs in and
sends the bytes out.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pydantic import BaseModel

from pagedbatch.engine.core.request import TokenLogprob
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.reasoning import ReasoningStream
from pagedbatch.protocol.schemas.chat import (
    ChatCompletionChunk,
    ChoiceDelta,
    ChunkChoice,
    FunctionCallDelta,
    ToolCallDelta,
)
from pagedbatch.protocol.schemas.common import SamplingRequest, Usage
from pagedbatch.protocol.schemas.completions import Completion, CompletionChoice
from pagedbatch.protocol.serving.chat import PreparedChat, new_tool_call, tool_calls_finish
from pagedbatch.protocol.serving.common import FinishReason, counted_usage, finish_reason
from pagedbatch.protocol.serving.completions import LogprobsWriter, PreparedCompletion

DONE = b"data: [DONE]\n\n"


@dataclass
class Delta:
    """What one choice gained since its last chunk."""

    index: int  # the choice's index in the response
    text: str
    logprobs: list[TokenLogprob]  # of the tokens generated since; empty unless asked for
    finish_reason: FinishReason | None  # set on the choice's last chunk only
    first: bool
    refusal: str | None = None  # why the content filter ended the choice
    token_ids: list[int] = field(default_factory=list)  # generated since the last chunk
    # On a choice's first delta, where the engine scored its prompt: the prompt's logprobs.
    prompt_logprobs: list[TokenLogprob | None] | None = None


class EventStream(Protocol):
    """The events of one streamed response, as the realtime door sends them: `begin` first,
    `events` whenever the engine's requests move, then `end` once all have finished, or `error`
    for a failure once under way. `final` is the response object the stream has told in full
    once it ended, where the endpoint has one (None for chat and completions chunks)."""

    final: BaseModel | None

    def begin(self) -> bytes: ...

    def events(self, outputs: Sequence[RequestOutput | None]) -> bytes: ...

    def end(self) -> bytes: ...

    def error(self, error: OpenAIError) -> bytes: ...

    def usage(self) -> Usage:
        """The tokens of what has been streamed so far."""


class ChunkWriter(Protocol):
    """An endpoint's chunk objects."""

    def chunk(self, delta: Delta) -> BaseModel: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...


def chunked(
    writer: Callable[[Any], ChunkWriter],
) -> Callable[[Any, SamplingRequest], StreamEncoder]:
    """The event stream of an endpoint that answers in `writer`'s chunks, then [DONE]."""
    return lambda prepared, request: StreamEncoder(writer(prepared), request)


@dataclass
class _Sent:
    """Where one choice stands."""

    started: bool = False
    finished: bool = False


class DeltaReader:
    """What each choice of a streamed request gained since the previous outputs, as Deltas, and
    the tokens of what has been streamed so far. Choice `index` of engine request `position` is
    the response's choice `position * n + index`, as in the non-streamed response."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._sent: defaultdict[int, _Sent] = defaultdict(_Sent)
        # For the usage, by engine request: its prompt's tokens (all, cached, image, audio), and
        # the tokens its completions generated.
        self._prompt_tokens: dict[int, tuple[int, int, int, int]] = {}
        self._completion_tokens = 0
        # By engine request: its prompt's logprobs, which one output carries, for the first
        # delta of each of its choices (which may come later: text held back for a stop string).
        self._prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}

    def usage(self) -> Usage:
        counts = self._prompt_tokens.values()
        prompt, cached, images, audio = (sum(c[i] for c in counts) for i in range(4))
        return counted_usage(prompt, self._completion_tokens, cached, images, audio)

    def deltas(self, outputs: Sequence[RequestOutput | None]) -> Iterator[Delta]:
        """The deltas of `outputs`: what each engine request said since the previous call, as a
        DELTA output (None if nothing). OpenAIError if a request was aborted or failed."""
        for position, output in enumerate(outputs):
            if output is None:
                continue
            self._prompt_tokens[position] = (
                len(output.prompt_token_ids),
                output.num_cached_tokens,
                output.num_image_tokens,
                output.num_audio_tokens,
            )
            if output.prompt_logprobs is not None:
                self._prompt_logprobs[position] = output.prompt_logprobs
            for choice in output.outputs:
                self._completion_tokens += len(choice.token_ids)
                index = position * self._n + choice.index
                sent = self._sent[index]
                if sent.finished:
                    continue
                delta = Delta(
                    index=index,
                    text=choice.text,
                    logprobs=choice.logprobs or [],
                    finish_reason=finish_reason(choice, output) if choice.finished else None,
                    first=not sent.started,
                    refusal=choice.refusal,
                    token_ids=list(choice.token_ids),
                    prompt_logprobs=None if sent.started else self._prompt_logprobs.get(position),
                )
                if not (delta.text or delta.logprobs or delta.finish_reason):
                    continue  # tokens whose text is held back (a stop string may be forming)
                sent.started = True
                sent.finished = choice.finished
                yield delta


class StreamEncoder:
    """The events of one streamed chat or completion: chunks as the outputs come, then usage
    and [DONE]."""

    final: BaseModel | None = None  # chunks tell no whole response

    def __init__(self, writer: ChunkWriter, request: SamplingRequest) -> None:
        self._writer = writer
        options = request.stream_options
        self._include_usage = options is not None and options.include_usage
        self._reader = DeltaReader(request.n)

    def begin(self) -> bytes:
        return b""  # a chat's first chunk carries its first delta

    def events(self, outputs: Sequence[RequestOutput | None]) -> bytes:
        """The events for `outputs` (see DeltaReader.deltas)."""
        return b"".join(
            self._event(self._writer.chunk(delta)) for delta in self._reader.deltas(outputs)
        )

    def end(self) -> bytes:
        """The events once every request has finished: usage if asked for, then [DONE]."""
        if not self._include_usage:
            return DONE
        return self._event(self._writer.usage_chunk(self.usage())) + DONE

    def usage(self) -> Usage:
        """The tokens of what has been streamed so far."""
        return self._reader.usage()

    @staticmethod
    def error(error: OpenAIError) -> bytes:
        """A failure once the response has begun: the SDK raises it as an APIError."""
        return b"data: " + json.dumps(error.body()).encode() + b"\n\n"

    def _event(self, chunk: BaseModel) -> bytes:
        # With include_usage every chunk says `"usage": null`; without it, none mentions usage.
        exclude = None if self._include_usage else {"usage"}
        return b"data: " + chunk.model_dump_json(exclude=exclude).encode() + b"\n\n"


@dataclass
class _ToolCallStream:
    """What one choice of a request that may call tools has said so far: its text, held until
    it is sure not to be part of a call, and the calls that have been completed."""

    text: str = ""
    content: str = ""  # sent as content
    calls: int = 0  # sent as tool calls


class ChatChunks:
    """`chat.completion.chunk` objects; a choice's first delta names the assistant's role.

    With tools, a tool call goes out as one delta once the model has closed it, and text that
    might open one waits until it cannot; the content and calls sent match the whole response's.
    """

    def __init__(self, prepared: PreparedChat) -> None:
        self._prepared = prepared
        self._tool_streams: defaultdict[int, _ToolCallStream] = defaultdict(_ToolCallStream)
        self._reasoning_streams: dict[int, ReasoningStream] = {}

    def chunk(self, delta: Delta) -> ChatCompletionChunk:
        reasoning = None
        if self._prepared.reasoning is not None:
            stream = self._reasoning_streams.setdefault(
                delta.index, ReasoningStream(self._prepared.reasoning)
            )
            split = stream.feed(delta.text, delta.token_ids, delta.finish_reason is not None)
            reasoning, delta = split.reasoning, replace(delta, text=split.content or "")
        content, calls = delta.text, []
        reason = delta.finish_reason
        if self._prepared.calls_tools:
            content, calls, reason = self._tool_calls(delta)
        choice = ChunkChoice(
            index=delta.index,
            delta=ChoiceDelta(
                role="assistant" if delta.first else None,
                content=content if content or not (calls or reasoning) else None,
                reasoning_content=reasoning,
                refusal=delta.refusal,
                tool_calls=calls or None,
            ),
            finish_reason=reason,
            logprobs=self._prepared.logprobs(delta.logprobs),
        )
        return self._chunk([choice])

    def _tool_calls(self, delta: Delta) -> tuple[str, list[ToolCallDelta], str | None]:
        stream = self._tool_streams[delta.index]
        stream.text += delta.text
        finished = delta.finish_reason is not None
        content, calls = self._prepared.split(stream.text, complete=finished)
        content = content or ""
        piece = content[len(stream.content) :]
        stream.content = content
        new = [
            ToolCallDelta(
                index=stream.calls + i,
                id=call.id,
                type="function",
                function=FunctionCallDelta(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for i, call in enumerate(new_tool_call(c) for c in calls[stream.calls :])
        ]
        stream.calls = len(calls)
        reason = delta.finish_reason
        return piece, new, reason and tool_calls_finish(reason, stream.calls > 0)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        thinking = sum(s.reasoning_tokens() for s in self._reasoning_streams.values())
        usage.completion_tokens_details.reasoning_tokens = thinking
        return self._chunk([], usage)

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        prepared = self._prepared
        return ChatCompletionChunk(
            id=prepared.id,
            created=prepared.created,
            model=prepared.model,
            choices=choices,
            usage=usage,
        )


class CompletionChunks:
    """`text_completion` objects; a choice's first delta starts with its prompt when echoed,
    and its logprobs with the prompt's, as vLLM streams them."""

    def __init__(self, prepared: PreparedCompletion) -> None:
        self._prepared = prepared
        # Each choice's logprobs continue where its last chunk's ended (text offsets).
        self._logprobs: dict[int, LogprobsWriter | None] = {}

    def chunk(self, delta: Delta) -> Completion:
        prepared = self._prepared
        text = delta.text
        logprobs = None
        if delta.first:
            position = delta.index // prepared.request.n
            echoed = prepared.echoed(position)
            text = echoed + text
            writer = self._logprobs[delta.index] = prepared.logprobs_writer(len(echoed))
            if writer is not None:
                prompt = prepared.inputs[position].prompt_token_ids
                logprobs = prepared.echoed_logprobs(writer, prompt, delta.prompt_logprobs)
        writer = self._logprobs[delta.index]
        choice = CompletionChoice(
            index=delta.index,
            text=text,
            finish_reason=delta.finish_reason,
            logprobs=None if writer is None else writer.write(delta.logprobs, into=logprobs),
        )
        return self._chunk([choice])

    def usage_chunk(self, usage: Usage) -> Completion:
        return self._chunk([], usage)

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        prepared = self._prepared
        return Completion(
            id=prepared.id,
            created=prepared.created,
            model=prepared.model,
            choices=choices,
            usage=usage,
        )

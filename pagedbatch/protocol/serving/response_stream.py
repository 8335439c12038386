"""A streamed Response: OpenAI's typed events, each an SSE `event:` line naming its type and a
`data:` line with the event, numbered by `sequence_number` from 0, and no [DONE].

In order: `response.created` and `response.in_progress` (the Response without output); a
reasoning model's thinking as it comes (`response.output_item.added` with the `reasoning` item,
`response.content_part.added`, `response.reasoning_text.delta`..., then `.done`,
`response.content_part.done` and `response.output_item.done` once its answer begins); the
assistant message as its text comes (`response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`...); once the engine has finished, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`, then each function call
(`response.output_item.added`, `response.function_call_arguments.delta` and `.done`,
`response.output_item.done`); last `response.completed` or `response.incomplete` with the whole
Response, whose items carry the ids the events gave them. A failure once under way is an
`error` event, then `response.failed`.

The text deltas join into exactly the message's text. With tools, text that might still open a
call is held until it cannot (as chat's stream holds it); calls go out once the output is
whole, after the message, which is where the Response lists them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.reasoning import ReasoningStream
from pagedbatch.protocol.schemas.common import Usage
from pagedbatch.protocol.schemas.responses import (
    ItemStatus,
    Logprob,
    OutputReasoningText,
    OutputText,
    Response,
)
from pagedbatch.protocol.serving.responses import (
    Answer,
    OutputIds,
    PreparedResponse,
    error_code,
    output_logprobs,
)
from pagedbatch.protocol.serving.streaming import Delta, DeltaReader


class ResponseEvents:
    """The events of one streamed Response (an EventStream for the realtime door)."""

    def __init__(self, prepared: PreparedResponse) -> None:
        self._prepared = prepared
        self._reader = DeltaReader(1)
        self._ids = OutputIds()
        self._sequence = 0
        self._text = ""  # everything the model said
        self._sent = ""  # the message text sent as deltas
        self._opened = False  # the message item has been added
        self._logprobs: list[Logprob] = []  # the text's, where `include` asks for them
        self._unsent_logprobs: list[Logprob] = []  # of the text not yet sent
        self._refusal: str | None = None
        self._reason: str | None = None
        self.final: Response | None = None
        splitter = prepared.chat.reasoning
        self._thinking = None if splitter is None else ReasoningStream(splitter)
        self._thought = ""  # the thinking sent as deltas
        self._thinking_open = False  # the reasoning item has been added and not yet done

    def begin(self) -> bytes:
        placeholder = self._prepared.placeholder("in_progress")
        return self._event("response.created", response=placeholder) + self._event(
            "response.in_progress", response=placeholder
        )

    def events(self, outputs: Sequence[RequestOutput | None]) -> bytes:
        return b"".join(self._delta(delta) for delta in self._reader.deltas(outputs))

    def end(self) -> bytes:
        """The closing events, once the engine has finished: the message done, the calls, and
        the Response completed or incomplete."""
        content, calls = self._split(complete=True)
        events = self._close_reasoning() + self._text_piece(content or "")
        self._logprobs.extend(self._unsent_logprobs)  # of tokens whose text showed nothing
        if self._opened or self._refusal or not calls:
            events += self._close_message()
        for i, call in enumerate(calls):
            item_id, call_id = self._ids.call(i)
            index = i + self._message_index + (1 if self._opened else 0)
            added = Answer.call(call, item_id, call_id, "in_progress")
            added.arguments = ""
            done = Answer.call(call, item_id, call_id, "completed")
            events += self._event("response.output_item.added", output_index=index, item=added)
            events += self._event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=index,
                delta=call.arguments,
            )
            events += self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                arguments=call.arguments,
            )
            events += self._event("response.output_item.done", output_index=index, item=done)
        reason = self._reason or "stop"
        answer = Answer(self._sent, calls, self._logprobs, self._refusal, reason, self._thought)
        self.final = self._prepared.finished(answer, self.usage(), self._ids)
        kind = "completed" if self.final.status == "completed" else "incomplete"
        return events + self._event(f"response.{kind}", response=self.final)

    def error(self, error: OpenAIError) -> bytes:
        """An `error` event, then `response.failed` with the Response that failed."""
        detail = error.detail
        self.final = self._prepared.failed(error, self.usage())
        return self._event(
            "error", code=error_code(error), message=detail.message, param=detail.param
        ) + self._event("response.failed", response=self.final)

    def usage(self) -> Usage:
        used = self._reader.usage()
        if self._thinking is not None:
            used.completion_tokens_details.reasoning_tokens = self._thinking.reasoning_tokens()
        return used

    @property
    def _message_index(self) -> int:
        """The message's place in the output: after the thinking, where there is one."""
        return 1 if self._thought else 0

    def _delta(self, delta: Delta) -> bytes:
        events, text = b"", delta.text
        if self._thinking is not None:
            split = self._thinking.feed(text, delta.token_ids, delta.finish_reason is not None)
            events, text = self._reasoning_piece(split.reasoning or ""), split.content or ""
            if text:
                events += self._close_reasoning()
        self._text += text
        if delta.refusal:
            self._refusal = delta.refusal
        if delta.finish_reason is not None:
            self._reason = delta.finish_reason
        logprobs = self._prepared.chat.logprobs(delta.logprobs)
        if logprobs is not None:
            self._unsent_logprobs.extend(output_logprobs(logprobs.content or []))
        if delta.finish_reason is not None:
            return events  # what is left of the text goes out with the end
        content, _ = self._split(complete=False)
        return events + self._text_piece(content or "")

    def _split(self, complete: bool) -> tuple[str | None, list[Any]]:
        return self._prepared.chat.split(self._text, complete)

    def _text_piece(self, content: str) -> bytes:
        """The delta of the message text up to `content` (a prefix of which has been sent)."""
        piece = content[len(self._sent) :]
        if not piece:
            return b""
        events = b"" if self._opened else self._open_message()
        self._sent = content
        logprobs, self._unsent_logprobs = self._unsent_logprobs, []
        self._logprobs.extend(logprobs)
        return events + self._event(
            "response.output_text.delta",
            item_id=self._ids.message,
            output_index=self._message_index,
            content_index=0,
            delta=piece,
            logprobs=logprobs,
        )

    def _open_message(self) -> bytes:
        self._opened = True
        item = Answer(None, [], [], None, "stop").message(self._ids.message, "in_progress")
        item.content = []
        where = {"output_index": self._message_index}
        return self._event("response.output_item.added", **where, item=item) + self._event(
            "response.content_part.added",
            item_id=self._ids.message,
            **where,
            content_index=0,
            part=OutputText(text=""),
        )

    def _close_message(self) -> bytes:
        events = b"" if self._opened else self._open_message()
        cut = self._reason in ("length", "content_filter")
        status: ItemStatus = "incomplete" if cut else "completed"
        answer = Answer(self._sent, [], self._logprobs, self._refusal, self._reason or "stop")
        message = answer.message(self._ids.message, status)
        where = {
            "item_id": self._ids.message,
            "output_index": self._message_index,
            "content_index": 0,
        }
        text = message.content[0]
        if isinstance(text, OutputText):
            events += self._event(
                "response.output_text.done", **where, text=text.text, logprobs=text.logprobs
            )
            events += self._event("response.content_part.done", **where, part=text)
        index = self._message_index
        return events + self._event("response.output_item.done", output_index=index, item=message)

    def _reasoning_piece(self, piece: str) -> bytes:
        """The thinking's delta `piece`, its item added first if this is the first."""
        if not piece:
            return b""
        where = {"item_id": self._ids.reasoning, "output_index": 0, "content_index": 0}
        events = b""
        if not self._thought:
            self._thinking_open = True
            item = Answer(None, [], [], None, "stop").thinking(self._ids.reasoning, "in_progress")
            events += self._event("response.output_item.added", output_index=0, item=item)
            events += self._event(
                "response.content_part.added", **where, part=OutputReasoningText(text="")
            )
        self._thought += piece
        return events + self._event("response.reasoning_text.delta", **where, delta=piece)

    def _close_reasoning(self) -> bytes:
        """The thinking's closing events, once its answer has begun (or the output ended)."""
        if not self._thinking_open:
            return b""
        self._thinking_open = False
        where = {"item_id": self._ids.reasoning, "output_index": 0, "content_index": 0}
        item = Answer(None, [], [], None, "stop", self._thought).thinking(
            self._ids.reasoning, "completed"
        )
        return (
            self._event("response.reasoning_text.done", **where, text=self._thought)
            + self._event("response.content_part.done", **where, part=item.content[0])
            + self._event("response.output_item.done", output_index=0, item=item)
        )

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence}
        data.update((key, _json(value)) for key, value in fields.items())
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _json(value: Any) -> Any:
    if isinstance(value, list):
        return [_json(item) for item in value]
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value

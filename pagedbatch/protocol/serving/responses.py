"""`/v1/responses`: input items in as a chat conversation, a Response out.

A request is the chat request it amounts to: `instructions` a system message first (as OpenAI
and vLLM place it), then the earlier turns a `previous_response_id` continues (`history`), then
its input items, `function_call` items an assistant's tool calls and `function_call_output` items
tool messages; function tools, `tool_choice` and `text.format` become chat's `tools`,
`tool_choice` and `response_format`. That chat request is prepared by `prepare_chat`, so the
prompt, the grammar that enforces a format or the calls, media, sampling and the engine request
are chat's own, and greedy output is chat's token for token. A refusal on the way names the
Responses field it came from (`input[2].content[0]`, `text.format`), not chat's.

The chat's answer then becomes the Response: a reasoning model's thinking a `reasoning` item
first, its text an assistant `message` item with an `output_text` part, each tool call a
`function_call` item with a fresh `call_id`. Earlier thinking sent back as input (a `reasoning`
item) stays out of the prompt, as reasoning models' chat templates leave it out.
"""

from __future__ import annotations

import base64
import binascii
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter
from transformers import PreTrainedTokenizerBase

from pagedbatch.engine.outputs import CompletionOutput, RequestOutput
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.chat import ChatCompletionRequest, ChatCompletionTokenLogprob
from pagedbatch.protocol.schemas.common import MAX_TEXT_CHARS, Usage
from pagedbatch.protocol.schemas.responses import (
    OUTPUT_LOGPROBS,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputAudioPart,
    InputFilePart,
    InputImagePart,
    InputItem,
    InputTextPart,
    InputTokensDetails,
    ItemStatus,
    JSONSchemaFormat,
    Logprob,
    MessageItem,
    OtherTool,
    OtherToolChoice,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputRefusal,
    OutputText,
    OutputTextPart,
    OutputTokensDetails,
    ReasoningItem,
    RefusalPart,
    Response,
    ResponseCreateRequest,
    ResponseError,
    ResponseReasoning,
    ResponseStatus,
    ResponseUsage,
)
from pagedbatch.protocol.serving.chat import PreparedChat, prepare_chat
from pagedbatch.protocol.serving.common import (
    EngineInput,
    ServedModel,
    finish_reason,
    new_id,
    not_supported,
    now,
    parse_request,
    usage,
)
from pagedbatch.protocol.tool_calls import ToolCall as ToolCallText

HISTORY = "previous_response_id"  # what a refusal of an earlier turn's item names
_ITEMS = TypeAdapter(list[InputItem])
_MESSAGES_PARAM = re.compile(r"^messages\[(\d+)\]")


@dataclass
class PreparedResponse:
    """A Responses request ready for the engine: chat's prepared request, and the Response
    around its answer. `id` ("resp_...") is also its engine request's id."""

    request: ResponseCreateRequest
    id: str
    created_at: int
    model: str
    chat: PreparedChat
    items: list[dict[str, Any]] = field(default_factory=list)  # this request's input items

    @property
    def inputs(self) -> list[EngineInput]:
        return self.chat.inputs

    @inputs.setter
    def inputs(self, inputs: list[EngineInput]) -> None:
        self.chat.inputs = inputs

    def input_texts(self) -> list[str]:
        """Each user message's text, earlier turns' included, as chat screens them."""
        return self.chat.input_texts()

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input items as OpenAI lists them (`GET .../input_items`): each with
        an id, messages with their content as parts."""
        return [dict(item) for item in self.items]

    def response(self, outputs: Sequence[RequestOutput]) -> Response:
        """The Response to the engine's final output: completed, or incomplete for a reply cut
        by max_output_tokens or the content filter. OpenAIError if the request was aborted
        or failed."""
        (output,) = outputs
        (choice,) = output.outputs
        reason = finish_reason(choice, output)  # raises for an abort or an engine failure
        thought, thinking = self.chat.thought(choice)
        content, calls = self.chat.split(thought.content or "")
        logprobs = self.logprobs(choice)
        answer = Answer(content, calls, logprobs, choice.refusal, reason, thought.reasoning)
        return self.finished(answer, usage(outputs, thinking))

    def finished(self, answer: Answer, used: Usage, ids: OutputIds | None = None) -> Response:
        """The Response holding `answer`; `ids`: the output items' ids, where a stream has
        named them already."""
        ids = ids or OutputIds()
        status: ResponseStatus = "completed"
        incomplete = None
        if answer.reason in ("length", "content_filter"):
            status = "incomplete"
            reason = "max_output_tokens" if answer.reason == "length" else "content_filter"
            incomplete = IncompleteDetails(reason=reason)
        output: list[OutputItem] = []
        if answer.reasoning:  # an empty one says nothing, and a stream has not opened it
            output.append(answer.thinking(ids.reasoning, "completed"))
        if answer.content or answer.refusal or not answer.calls:
            output.append(answer.message(ids.message, "incomplete" if incomplete else "completed"))
        output.extend(
            answer.call(call, *ids.call(i), "completed") for i, call in enumerate(answer.calls)
        )
        response = self.placeholder(status)
        response.output = output
        response.incomplete_details = incomplete
        response.usage = response_usage(used)
        response.completed_at = now() if status == "completed" else None
        return response

    def failed(self, error: OpenAIError, used: Usage | None = None) -> Response:
        """The Response of a request that failed once under way (a stream's last event)."""
        response = self.placeholder("failed")
        response.error = ResponseError(code=error_code(error), message=str(error))
        response.usage = None if used is None else response_usage(used)
        return response

    def placeholder(self, status: ResponseStatus) -> Response:
        """The Response before it has output: `queued` or `in_progress` (a stream's first
        events, a background response's first answer)."""
        request = self.request
        return Response(
            id=self.id,
            created_at=self.created_at,
            status=status,
            background=request.background,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            model=self.model,
            output=[],
            parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id,
            reasoning=ResponseReasoning.model_validate(
                request.reasoning.model_dump() if request.reasoning else {}
            ),
            store=request.store,
            temperature=request.temperature,
            text=request.text,
            tool_choice=request.tool_choice or "auto",
            tools=request.tools or [],
            top_logprobs=request.top_logprobs or 0,
            top_p=request.top_p,
            truncation=request.truncation,
            user=request.user,
            metadata=request.metadata or {},
        )

    def logprobs(self, choice: CompletionOutput) -> list[Logprob]:
        """The logprobs of these tokens, if `include` asked for them."""
        chat = self.chat.logprobs(choice.logprobs or [])
        return [] if chat is None else output_logprobs(chat.content or [])


@dataclass
class Answer:
    """What the model said: its text (None if only calls), its tool calls, the text's
    logprobs, the content filter's refusal, and why it ended."""

    content: str | None
    calls: list[ToolCallText]
    logprobs: list[Logprob]
    refusal: str | None
    reason: str
    reasoning: str | None = None  # a reasoning model's thinking, before the rest

    def thinking(self, item_id: str, status: ItemStatus) -> OutputReasoning:
        text = [OutputReasoningText(text=self.reasoning)] if self.reasoning is not None else []
        return OutputReasoning(id=item_id, content=text, status=status)

    def message(self, item_id: str, status: ItemStatus) -> OutputMessage:
        # The text first, if only an empty one: a stream has opened it before it knows the end.
        parts: list[OutputText | OutputRefusal] = [
            OutputText(text=self.content or "", logprobs=self.logprobs)
        ]
        if self.refusal:
            parts.append(OutputRefusal(refusal=self.refusal))
        return OutputMessage(id=item_id, status=status, content=parts)

    @staticmethod
    def call(
        call: ToolCallText, item_id: str, call_id: str, status: ItemStatus
    ) -> OutputFunctionCall:
        return OutputFunctionCall(
            id=item_id, call_id=call_id, name=call.name, arguments=call.arguments, status=status
        )


@dataclass
class OutputIds:
    """The ids of a Response's output items: its message's, and each call's (item, call_id),
    made as they are first asked for."""

    message: str = field(default_factory=lambda: new_id("msg_"))
    reasoning: str = field(default_factory=lambda: new_id("rs_"))
    calls: list[tuple[str, str]] = field(default_factory=list)

    def call(self, index: int) -> tuple[str, str]:
        while len(self.calls) <= index:
            self.calls.append((new_id("fc_"), new_id("call_")))
        return self.calls[index]


def response_usage(used: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=used.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=used.prompt_tokens_details.cached_tokens
        ),
        output_tokens=used.completion_tokens,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=used.completion_tokens_details.reasoning_tokens
        ),
        total_tokens=used.total_tokens,
    )


def output_logprobs(tokens: Sequence[ChatCompletionTokenLogprob]) -> list[Logprob]:
    return [Logprob.model_validate(token.model_dump()) for token in tokens]


def error_code(error: OpenAIError) -> str:
    """The Response `error.code` of a failure (OpenAI's few: the server's, a rate limit, or a
    prompt it would not take)."""
    if error.status_code >= 500:
        return "server_error"
    return "rate_limit_exceeded" if error.status_code == 429 else "invalid_prompt"


def previous_response_not_found(previous: str) -> OpenAIError:
    """The 404 of a `previous_response_id` that is not the caller's response (never one,
    deleted, expired, or another tenant's)."""
    return OpenAIError(
        f"Previous response with id '{previous}' not found.",
        status_code=404,
        param="previous_response_id",
        code="previous_response_not_found",
    )


def previous_response_not_finished(previous: str, status: str) -> OpenAIError:
    """The 400 of a `previous_response_id` whose response has not ended (`status`): a
    conversation goes on only from a whole turn."""
    return OpenAIError(
        f"Previous response with id '{previous}' is still {status}: a conversation "
        "continues from a response that has ended.",
        param="previous_response_id",
        code="previous_response_not_finished",
    )


def conversation_too_long(previous: str) -> OpenAIError:
    """The 400 of a conversation longer than the service reads for one request, without
    `truncation: auto` to drop its oldest turns."""
    return OpenAIError(
        f"The conversation that previous_response_id '{previous}' continues is longer than "
        "this service reads for one request (PAGEDBATCH_RESPONSE_HISTORY_MAX_TURNS and _BYTES): "
        "use truncation 'auto' to drop its oldest turns, or start a new conversation.",
        param="previous_response_id",
        code="context_length_exceeded",
    )


def prepare_response(
    request: ResponseCreateRequest,
    served: ServedModel,
    history: Sequence[dict[str, Any]] = (),
    history_cut: bool = False,
) -> PreparedResponse:
    """The engine request for `request`, continuing `history`: the earlier turns of the
    conversation `previous_response_id` names, as JSON items (that response's input items,
    then its output items, oldest first), less its oldest turns where `history_cut` (they were
    past what the service reads for a request: only `truncation: auto` may drop them).
    OpenAIError 400 naming the field at fault."""
    if history_cut and request.truncation != "auto":
        raise conversation_too_long(request.previous_response_id or "")
    _refuse_unsupported(request, continued=bool(history) or history_cut)
    reasoning = request.reasoning
    if reasoning is not None and reasoning.effort is not None and served.reasoning_tags is None:
        raise OpenAIError(
            "Unsupported parameter: 'reasoning.effort' is not supported with this model.",
            param="reasoning.effort",
            code="unsupported_parameter",
        )
    own = _own_items(request)
    where = (
        ["input"] if isinstance(request.input, str) else [f"input[{i}]" for i in range(len(own))]
    )
    conversation = [(item, HISTORY) for item in _ITEMS.validate_python(list(history))]
    conversation += zip(own, where, strict=True)
    if request.truncation == "auto":
        chat = _fitted(request, served, conversation)
    else:
        chat = _prepared_chat(request, served, conversation)
    response_id = new_id("resp_")
    chat.id = response_id
    chat.inputs = [
        EngineInput(response_id, i.prompt_token_ids, i.params, i.media) for i in chat.inputs
    ]
    return PreparedResponse(
        request=request,
        id=response_id,
        created_at=now(),
        model=served.model_name,
        chat=chat,
        items=[_listed(item) for item in own],
    )


Conversation = list[tuple[Any, str]]  # items, each with the Responses field it came from


def _prepared_chat(
    request: ResponseCreateRequest, served: ServedModel, conversation: Conversation
) -> PreparedChat:
    """The chat request `request` amounts to with `conversation`'s items, prepared; a refusal
    names the Responses field at fault."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []  # for each message, the Responses field it came from
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        sources.append("instructions")
    for item, where in conversation:
        _add_item(messages, sources, item, where)
    try:
        chat_request = parse_request(ChatCompletionRequest, _chat_body(request, messages))
        return prepare_chat(chat_request, served)
    except OpenAIError as error:
        raise _blamed(error, sources) from None


def _fitted(
    request: ResponseCreateRequest, served: ServedModel, conversation: Conversation
) -> PreparedChat:
    """`truncation: auto`: the conversation less as few of its oldest items as leave room in
    the context (the instructions and the last item always stay, and a tool's output never
    outlives the call it answers). Fewer items never take more tokens, so the fewest to drop
    is found by bisection, a prompt tokenized for each try, among the suffixes whose text is
    not surely too long: what each try costs is bounded by the context, not by the request."""

    def attempt(dropped: int) -> PreparedChat | OpenAIError:
        kept = conversation[dropped:]
        while len(kept) > 1 and isinstance(kept[0][0], FunctionCallOutputItem):
            kept = kept[1:]
        try:
            return _prepared_chat(request, served, kept)
        except OpenAIError as error:
            if error.detail.code != "context_length_exceeded":
                raise
            return error

    # Dropping `low` items does not fit; dropping `high` is the most allowed.
    low, high = _surely_too_long(conversation, served) - 1, len(conversation) - 1
    if low < 0:
        whole = attempt(0)
        if not isinstance(whole, OpenAIError):
            return whole
        low = 0
    best = attempt(high)
    if isinstance(best, OpenAIError):
        raise best
    while high - low > 1:
        middle = (low + high) // 2
        tried = attempt(middle)
        if isinstance(tried, OpenAIError):
            low = middle
        else:
            high, best = middle, tried
    return best


def _surely_too_long(conversation: Conversation, served: ServedModel) -> int:
    """How many of the oldest items must go, whatever the template, for the rest to fit (at
    most all but the last): a token of text covers at most `longest_token_bytes` of it, so text
    of more bytes than that many times the context takes more tokens than the context holds."""
    most = longest_token_bytes(served.tokenizer) * served.max_model_len
    kept = 0
    for index in range(len(conversation) - 1, 0, -1):
        kept += _text_bytes(conversation[index][0])
        if kept > most:
            return index + 1
    return 0


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most UTF-8 bytes of text one token of `tokenizer` stands for (81 for SmolLM2's: a
    run of spaces), computed once per tokenizer (a second or so for a large vocabulary)."""
    found = _LONGEST_TOKEN_BYTES.get(tokenizer)
    if found is None:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        found = _LONGEST_TOKEN_BYTES[tokenizer] = max(len(t.encode()) for t in texts)
    return found


_LONGEST_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _text_bytes(item: Any) -> int:
    """UTF-8 bytes of the text `item` brings to the prompt, as a template may trim it (its
    images, audio and files count none): a lower bound on the tokens it takes, times the
    longest token's bytes."""
    if isinstance(item, FunctionCallItem):
        texts = [item.name, item.arguments]
    elif isinstance(item, FunctionCallOutputItem):
        output = item.output
        texts = [output] if isinstance(output, str) else [getattr(p, "text", "") for p in output]
    elif isinstance(item.content, str):
        texts = [item.content]
    else:
        texts = [getattr(p, "text", None) or getattr(p, "refusal", "") for p in item.content]
    return sum(len(text.strip().encode()) for text in texts)


def _refuse_unsupported(request: ResponseCreateRequest, continued: bool) -> None:
    """`continued`: the conversation `previous_response_id` names was found (read, or cut
    down to nothing by the bounds on reading it)."""
    if request.previous_response_id is not None and not continued:
        # Only the store knows an earlier response; without it, nothing continues one.
        raise not_supported("previous_response_id", "previous_response_id")
    if request.input is None or request.input == []:
        raise OpenAIError(
            "Missing required parameter: 'input'.",
            param="input",
            code="missing_required_parameter",
        )
    for i, tool in enumerate(request.tools or []):
        if isinstance(tool, OtherTool):
            raise OpenAIError(
                f"Tools of type '{tool.type}' are not supported: this server runs function "
                "tools only, which the client calls.",
                param=f"tools[{i}]",
                code="unsupported_parameter",
            )
    if isinstance(request.tool_choice, OtherToolChoice):
        raise OpenAIError(
            f"tool_choice of type '{request.tool_choice.type}' is not supported: this server "
            "runs function tools only.",
            param="tool_choice",
            code="unsupported_parameter",
        )


def _own_items(request: ResponseCreateRequest) -> list[Any]:
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input)]
    return list(request.input or [])


def _add_item(messages: list[dict[str, Any]], sources: list[str], item: Any, where: str) -> None:
    """`item` added to the chat `messages`: a message, a tool call (joining the assistant
    message before it, so parallel calls make one turn, as chat has them) or a tool's output;
    an earlier thinking adds nothing."""
    if isinstance(item, ReasoningItem):
        return
    if isinstance(item, FunctionCallItem):
        call = {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and sources[-1] != "instructions":
            last.setdefault("tool_calls", []).append(call)
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif isinstance(item, FunctionCallOutputItem):
        output = item.output
        if not isinstance(output, str):
            output = [
                _tool_output_part(part, f"{where}.output[{j}]") for j, part in enumerate(output)
            ]
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    else:
        content = item.content
        if not isinstance(content, str):
            content = [
                _chat_part(part, item.role, f"{where}.content[{j}]")
                for j, part in enumerate(content)
            ]
        messages.append({"role": item.role, "content": content})
    sources.append(where)


def _chat_part(part: Any, role: str, param: str) -> dict[str, Any]:
    """A message's content part as chat's; a part its role cannot hold is a 400."""
    if isinstance(part, InputTextPart):
        return {"type": "text", "text": part.text}
    if role == "assistant":  # an earlier answer sent back
        if isinstance(part, OutputTextPart):
            return {"type": "text", "text": part.text}
        if isinstance(part, RefusalPart):
            return {"type": "refusal", "refusal": part.refusal}
    if role == "user":
        if isinstance(part, InputImagePart):
            return {"type": "image_url", "image_url": _image_url(part, param)}
        if isinstance(part, InputAudioPart):
            return {"type": "input_audio", "input_audio": part.input_audio.model_dump()}
        if isinstance(part, InputFilePart):
            return {"type": "text", "text": _file_text(part, param)}
    raise OpenAIError(
        f"Invalid value for '{param}': a {role} message cannot hold a part of type '{part.type}'.",
        param=f"{param}.type",
        code="invalid_value",
    )


def _tool_output_part(part: Any, param: str) -> dict[str, Any]:
    if isinstance(part, InputTextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, InputFilePart):
        return {"type": "text", "text": _file_text(part, param)}
    raise OpenAIError(
        f"Content parts of type '{part.type}' are not supported in a function call's output.",
        param=param,
        code="unsupported_content_type",
    )


def _image_url(part: InputImagePart, param: str) -> dict[str, str]:
    if part.file_id is not None:
        raise not_supported("An image by file_id (send its image_url)", f"{param}.file_id")
    if part.image_url is None:
        raise OpenAIError(
            f"Missing required parameter: '{param}.image_url'.",
            param=f"{param}.image_url",
            code="missing_required_parameter",
        )
    detail = part.detail if part.detail in ("low", "high") else "auto"
    return {"url": part.image_url, "detail": detail}


def _file_text(part: InputFilePart, param: str) -> str:
    """The text an input file holds: its `file_data` (base64, or a base64 data: URL) as
    UTF-8. Files by id or URL, and files that are not text, are refused."""
    if part.file_data is None:
        which = "file_id" if part.file_id is not None else "file_url"
        if part.file_id is None and part.file_url is None:
            which = "file_data"
        raise OpenAIError(
            f"Input files are taken as file_data only (base64 of UTF-8 text); '{param}' has "
            f"no file_data.",
            param=f"{param}.{which}",
            code="unsupported_parameter",
        )
    data = part.file_data
    if data.startswith("data:"):
        header, _, data = data.partition(",")
        if not header.endswith(";base64"):
            raise OpenAIError(
                "Invalid file_data: a data: URL must be base64 (data:<type>;base64,<data>).",
                param=f"{param}.file_data",
            )
    try:
        raw = base64.b64decode(data, validate=True)
        text = raw.decode()
    except (binascii.Error, ValueError):
        raise OpenAIError(
            "Invalid file_data: only text files are read, given as base64 of UTF-8 text.",
            param=f"{param}.file_data",
            code="unsupported_content_type",
        ) from None
    if len(text) > MAX_TEXT_CHARS:
        raise OpenAIError(
            f"The file is too long: more than {MAX_TEXT_CHARS} characters.",
            param=f"{param}.file_data",
        )
    return text


def _chat_body(request: ResponseCreateRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request (as JSON) that `request` amounts to, with `messages`."""
    logprobs = OUTPUT_LOGPROBS in (request.include or [])
    tools = [tool.model_dump(exclude={"type"}, exclude_none=True) for tool in request.tools or []]
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "stream": request.stream,
        "user": request.user,
        "tools": [{"type": "function", "function": tool} for tool in tools] or None,
        "tool_choice": _chat_tool_choice(request),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _chat_format(request),
        "logprobs": logprobs,
        "top_logprobs": request.top_logprobs if logprobs else None,
        "reasoning_effort": request.reasoning.effort if request.reasoning else None,
    }
    return body


def _chat_tool_choice(request: ResponseCreateRequest) -> Any:
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type == "function":
        return {"type": "function", "function": {"name": choice.name}}
    # allowed_tools: each tool as Responses names it ({"type": "function", "name"}).
    tools = [{"type": "function", "function": {"name": t.get("name")}} for t in choice.tools]
    return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": tools}}


def _chat_format(request: ResponseCreateRequest) -> dict[str, Any]:
    form = request.text.format
    if not isinstance(form, JSONSchemaFormat):
        return {"type": form.type}
    spec = form.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
    return {"type": "json_schema", "json_schema": spec}


# Chat's names for what a Responses request calls otherwise.
_RENAMED = {
    "messages": "input",
    "response_format": "text.format",
    "response_format.json_schema": "text.format",
    "max_completion_tokens": "max_output_tokens",
}


def _blamed(error: OpenAIError, sources: list[str]) -> OpenAIError:
    """`error`, raised for the chat request, naming the Responses field at fault instead."""
    param = error.detail.param
    if param is None:
        return error
    match = _MESSAGES_PARAM.match(param)
    if match is not None:
        source = sources[int(match.group(1))]
        renamed = source if source in (HISTORY, "instructions") else source + param[match.end() :]
    else:
        head, dot, rest = param.partition(".")
        renamed = _RENAMED.get(param) or (
            "text.format" + dot + rest.removeprefix("json_schema.").removeprefix("json_schema")
            if head == "response_format"
            else param
        )
        renamed = renamed.rstrip(".")
    message = error.detail.message.replace(f"'{param}'", f"'{renamed}'")
    message = message.replace("response_format", "text.format").replace("the messages", "the input")
    error.detail = error.detail.model_copy(update={"param": renamed, "message": message})
    return error


def _listed(item: Any) -> dict[str, Any]:
    """An input item as `GET /v1/responses/{id}/input_items` lists it."""
    if isinstance(item, FunctionCallItem):
        listed = item.model_dump(exclude_none=True)
        listed.setdefault("id", new_id("fc_"))
    elif isinstance(item, FunctionCallOutputItem):
        listed = item.model_dump(exclude_none=True)
        listed.setdefault("id", new_id("fco_"))
    elif isinstance(item, ReasoningItem):
        listed = item.model_dump(exclude_none=True)
        listed.setdefault("id", new_id("rs_"))
    else:
        content = item.content
        if isinstance(content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            parts: list[dict[str, Any]] = [{"type": kind, "text": content}]
        else:
            parts = [part.model_dump(exclude_none=True) for part in content]
        listed = {
            "id": item.id or new_id("msg_"),
            "type": "message",
            "role": item.role,
            "content": parts,
        }
    listed["status"] = "completed"
    return listed

"""`/v1/chat/completions`: messages in through the model's chat template, a ChatCompletion out.

`response_format`, `tools` and `tool_choice` become a grammar the engine enforces token by token
(protocol/structured_output.py), so JSON and tool calls are well-formed whatever the model; tool
calls come back out of the text as `tool_calls` (protocol/tool_calls.py). A reasoning model's
grammar applies after its thinking, as vLLM's: from the token after `</think>`, or from the
first where the prompt has closed the thinking.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Any, Literal

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from pagedbatch.engine.core.request import TokenLogprob
from pagedbatch.engine.multimodal.inputs import Modality
from pagedbatch.engine.outputs import CompletionOutput, RequestOutput
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.reasoning import NO_THINKING, ReasoningSplitter, Split
from pagedbatch.protocol.schemas.chat import (
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionTokenLogprob,
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    FunctionCall,
    RefusalPart,
    TextPart,
    ToolCall,
    TopLogprob,
)
from pagedbatch.protocol.serving.common import (
    EngineInput,
    FinishReason,
    ServedModel,
    TokenPieces,
    beam_params,
    check_context_length,
    check_model,
    encode_prompt,
    finish_reason,
    new_id,
    not_supported,
    now,
    sampling_params,
    usage,
)
from pagedbatch.protocol.serving.media import PART_MODALITY, decode_media, place_media, takes
from pagedbatch.protocol.serving.prompt_logprobs import prompt_logprobs
from pagedbatch.protocol.structured_output import RequestedOutput, from_openai
from pagedbatch.protocol.tool_calls import ToolCall as ToolCallText
from pagedbatch.protocol.tool_calls import parse_tool_calls

GRAMMAR_SPECS_CACHED = 256  # batch lines repeat their schema and tools: build each grammar once


@dataclass
class PreparedChat:
    request: ChatCompletionRequest
    id: str
    created: int
    model: str
    tokenizer: PreTrainedTokenizerBase
    inputs: list[EngineInput]
    calls_tools: bool = False  # the output may hold tool calls, to be returned as `tool_calls`
    reasoning: ReasoningSplitter | None = None  # a reasoning model's: thinking apart from content

    def input_texts(self) -> list[str]:
        """Each user message's text (its text parts together)."""
        texts = []
        for message in self.request.messages:
            if message.role != "user":
                continue
            content = message.content
            if isinstance(content, str):
                texts.append(content)
            else:
                texts.append("\n".join(part.text for part in content if part.type == "text"))
        return texts

    def response(self, outputs: Sequence[RequestOutput]) -> ChatCompletion:
        (output,) = outputs
        choices = []
        reasoning_tokens = 0
        for choice in output.outputs:
            thought, thinking = self.thought(choice)
            reasoning_tokens += thinking
            content, calls = self.split(thought.content or "")
            choices.append(
                Choice(
                    index=choice.index,
                    message=ChatCompletionMessage(
                        content=content if thought.content is not None else None,
                        reasoning_content=thought.reasoning,
                        refusal=choice.refusal,
                        tool_calls=[new_tool_call(c) for c in calls] or None,
                    ),
                    finish_reason=self.finish_reason(choice, output, bool(calls)),
                    logprobs=self.logprobs(choice.logprobs or []),
                )
            )
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage(outputs, reasoning_tokens),
            prompt_logprobs=prompt_logprobs(
                output.prompt_logprobs, self.request.prompt_logprobs, self.pieces
            ),
        )

    def thought(self, choice: CompletionOutput) -> tuple[Split, int]:
        """A whole choice's thinking and the rest, and how many of its tokens are thinking (all
        of it the rest, none thinking, for a model that does not reason)."""
        if self.reasoning is None:
            return Split(None, choice.text), 0
        thought = self.reasoning.split(choice.text)
        return thought, self.reasoning.reasoning_tokens(choice.token_ids, thought)

    def split(self, text: str, complete: bool = True) -> tuple[str | None, list[ToolCallText]]:
        """A choice's text as (content, tool calls); see `parse_tool_calls` for `complete`."""
        if not self.calls_tools:
            return text, []
        return parse_tool_calls(text, complete)

    @staticmethod
    def finish_reason(
        choice: CompletionOutput, output: RequestOutput, called: bool
    ) -> FinishReason | Literal["tool_calls"]:
        return tool_calls_finish(finish_reason(choice, output), called)

    @cached_property
    def pieces(self) -> TokenPieces:
        return TokenPieces(self.tokenizer)

    def logprobs(self, token_logprobs: Sequence[TokenLogprob]) -> ChoiceLogprobs | None:
        """The logprobs of these tokens of a choice, if the request asked for them."""
        if not self.request.logprobs:
            return None
        pieces = self.pieces

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            return {
                "token": pieces.text(token_id),
                "logprob": logprob,
                "bytes": list(pieces.bytes(token_id)),
            }

        return ChoiceLogprobs(
            content=[
                ChatCompletionTokenLogprob(
                    **entry(lp.token_id, lp.logprob),
                    top_logprobs=[TopLogprob(**entry(t, v)) for t, v in lp.top],
                )
                for lp in token_logprobs
            ]
        )


def prepare_chat(request: ChatCompletionRequest, served: ServedModel) -> PreparedChat:
    """The engine request for `request`; OpenAIError if it cannot be served."""
    lora_name = check_model(request.model, served)
    _refuse_unsupported(request)
    requested = requested_output(request)
    tokenizer = served.tokenizer
    tools = [tool.model_dump(mode="json", exclude_none=True) for tool in request.tools or []]
    media = decode_media(request.messages, served)
    thinking = None if request.reasoning_effort is None else request.reasoning_effort != NO_THINKING
    text = render_chat(request.messages, tokenizer, tools, takes(served), thinking)
    max_tokens = request.max_completion_tokens or request.max_tokens  # None: up to the context
    prompt = encode_prompt(text, max_tokens, served, param="messages", add_special_tokens=False)
    prompt, items = place_media(prompt, media, served)
    check_context_length(len(prompt), max_tokens, served, param="messages")
    beam = beam_params(request, max_tokens, len(prompt), served)
    if beam is not None and (requested is not None or items):
        raise not_supported("Beam search with structured output, tools or media", "use_beam_search")
    reasoning = ReasoningSplitter.for_prompt(served.reasoning_tags, text, tokenizer)
    structured = None if requested is None else requested.structured
    if structured is not None and reasoning is not None:
        # As vLLM: a reasoning model thinks freely, and its answer obeys.
        after = reasoning.grammar_starts_after(prompt)
        structured = replace(structured, starts_after=after)
    params = sampling_params(
        request,
        max_tokens=max_tokens,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        tokenizer=tokenizer,
        structured=structured,
    )
    chat_id = new_id("chatcmpl-")
    return PreparedChat(
        request=request,
        id=chat_id,
        created=now(),
        model=served.model_name,
        tokenizer=tokenizer,
        inputs=[
            EngineInput(chat_id, prompt, params, items, request.priority, lora_name, beam=beam)
        ],
        calls_tools=requested is not None and bool(requested.tool_names),
        reasoning=reasoning,
    )


def tool_calls_finish(reason: FinishReason, called: bool) -> FinishReason | Literal["tool_calls"]:
    """A choice that made calls and stopped by itself ends for them, as OpenAI reports it."""
    return "tool_calls" if called and reason == "stop" else reason


def new_tool_call(call: ToolCallText) -> ToolCall:
    return ToolCall(
        id=new_id("call_"), function=FunctionCall(name=call.name, arguments=call.arguments)
    )


def requested_output(request: ChatCompletionRequest) -> RequestedOutput | None:
    """What the request's output must be, or None; 400 naming the field at fault."""
    response_format = (
        None
        if request.response_format is None
        else request.response_format.model_dump(mode="json", by_alias=True, exclude_none=True)
    )
    tools = [tool.model_dump(mode="json", exclude_none=True) for tool in request.tools or []]
    choice = request.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump(mode="json", exclude_none=True)
    try:
        # Checked apart first, so that a bad schema is blamed on response_format, not on tools.
        _grammar(json.dumps([response_format, None, None, True]))
    except ValueError as e:
        raise _invalid("response_format", e) from None
    try:
        return _grammar(
            json.dumps([response_format, tools or None, choice, request.parallel_tool_calls])
        )
    except ValueError as e:
        raise _invalid("tool_choice" if str(e).startswith("tool_choice") else "tools", e) from None


@lru_cache(maxsize=GRAMMAR_SPECS_CACHED)
def _grammar(spec: str) -> RequestedOutput | None:
    response_format, tools, choice, parallel = json.loads(spec)
    return from_openai(response_format, tools, choice, parallel)


def _invalid(param: str, error: ValueError) -> OpenAIError:
    return OpenAIError(f"Invalid '{param}': {error}.", param=param, code="invalid_value")


def render_chat(
    messages: Sequence[ChatMessage],
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[dict[str, Any]] = (),
    media: Collection[Modality] = (),
    thinking: bool | None = None,
) -> str:
    """The prompt text: the messages (and the tools on offer) through the chat template, ready
    for the assistant's turn. For a model that reads `media`, a message with images or clips
    keeps its parts, as `{"type": "image"}` or `{"type": "audio"}`, for the template to place
    their placeholder tokens. `thinking` is a reasoning model's switch where its template has
    one (Qwen3's `enable_thinking`); None leaves the template's default."""
    if tokenizer.chat_template is None:
        raise OpenAIError(
            "This model has no chat template: use /v1/completions, or start the model with a "
            "chat_template setting.",
            param="messages",
        )
    conversation = [_template_message(i, message, media) for i, message in enumerate(messages)]
    try:
        switch = {} if thinking is None else {"enable_thinking": thinking}
        return tokenizer.apply_chat_template(
            conversation,
            tools=list(tools) or None,
            tokenize=False,
            add_generation_prompt=True,
            **switch,
        )
    except TemplateError as exc:  # templates reject e.g. roles out of order
        raise OpenAIError(
            f"The model's chat template rejected these messages: {exc}", param="messages"
        ) from None


def _template_message(
    index: int, message: ChatMessage, media: Collection[Modality]
) -> dict[str, Any]:
    """The message as chat templates take it: content as one string, text parts joined as vLLM
    does; but a message with images or clips the model reads keeps its parts in order."""
    rendered = message.model_dump(exclude_none=True)
    content = message.content
    if content is None:
        rendered["content"] = ""
    elif not isinstance(content, str):
        parts: list[dict[str, str]] = []
        for j, part in enumerate(content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, RefusalPart):
                parts.append({"type": "text", "text": part.refusal})
            elif PART_MODALITY.get(type(part)) in media:
                parts.append({"type": PART_MODALITY[type(part)]})
            else:
                raise OpenAIError(
                    f"Content parts of type '{part.type}' are not supported by this model.",
                    param=f"messages[{index}].content[{j}]",
                    code="unsupported_content_type",
                )
        if any(part["type"] != "text" for part in parts):
            rendered["content"] = parts
        else:
            rendered["content"] = "\n".join(part["text"] for part in parts)
    return rendered


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    for i, tool in enumerate(request.tools or []):
        if tool.type != "function":
            raise not_supported(f"Tools of type '{tool.type}'", f"tools[{i}]")
    if request.functions or request.function_call is not None:
        raise not_supported("The deprecated `functions` (use `tools`)", "functions")
    if request.audio is not None:
        raise not_supported("Audio output", "audio")
    if "audio" in (request.modalities or []):
        raise not_supported("Audio output", "modalities")

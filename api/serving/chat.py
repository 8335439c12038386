"""`/v1/chat/completions`: messages in through the model's chat template, a ChatCompletion out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from pagedbatch.api.errors import OpenAIError
from pagedbatch.api.schemas.chat import (
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionTokenLogprob,
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    RefusalPart,
    TextPart,
    TopLogprob,
)
from pagedbatch.api.serving.common import (
    EngineInput,
    ServedModel,
    TokenPieces,
    check_context_length,
    check_model,
    finish_reason,
    new_id,
    not_supported,
    now,
    sampling_params,
    usage,
)
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.engine.request import TokenLogprob


@dataclass
class PreparedChat:
    request: ChatCompletionRequest
    id: str
    created: int
    model: str
    tokenizer: PreTrainedTokenizerBase
    inputs: list[EngineInput]

    def response(self, outputs: Sequence[RequestOutput]) -> ChatCompletion:
        (output,) = outputs
        choices = [
            Choice(
                index=choice.index,
                message=ChatCompletionMessage(content=choice.text),
                finish_reason=finish_reason(choice, output),
                logprobs=self.logprobs(choice.logprobs or []),
            )
            for choice in output.outputs
        ]
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage(outputs),
        )

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
    check_model(request.model, served)
    _refuse_unsupported(request)
    tokenizer = served.tokenizer
    prompt = tokenizer.encode(render_chat(request.messages, tokenizer), add_special_tokens=False)
    max_tokens = request.max_completion_tokens or request.max_tokens  # None: up to the context
    check_context_length(len(prompt), max_tokens, served, param="messages")
    params = sampling_params(
        request,
        max_tokens=max_tokens,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        tokenizer=tokenizer,
    )
    chat_id = new_id("chatcmpl-")
    return PreparedChat(
        request=request,
        id=chat_id,
        created=now(),
        model=served.model_name,
        tokenizer=tokenizer,
        inputs=[EngineInput(chat_id, prompt, params)],
    )


def render_chat(messages: Sequence[ChatMessage], tokenizer: PreTrainedTokenizerBase) -> str:
    """The prompt text: the messages through the chat template, ready for the assistant's turn."""
    conversation = [_template_message(i, message) for i, message in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
    except TemplateError as exc:  # templates reject e.g. roles out of order
        raise OpenAIError(
            f"The model's chat template rejected these messages: {exc}", param="messages"
        ) from None


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    # Chat templates expect content as one string; text parts are joined as vLLM does.
    rendered = message.model_dump(exclude_none=True)
    content = message.content
    if content is None:
        rendered["content"] = ""
    elif not isinstance(content, str):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, TextPart):
                texts.append(part.text)
            elif isinstance(part, RefusalPart):
                texts.append(part.refusal)
            else:
                raise OpenAIError(
                    f"Content parts of type '{part.type}' are not supported: this model reads "
                    "text only.",
                    param=f"messages[{index}].content[{j}]",
                    code="unsupported_content_type",
                )
        rendered["content"] = "\n".join(texts)
    return rendered


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    if request.tools:
        raise not_supported("Tool calling", "tools")
    if request.functions:
        raise not_supported("Function calling", "functions")
    if request.response_format is not None and request.response_format.type != "text":
        raise not_supported(f"response_format '{request.response_format.type}'", "response_format")
    if request.audio is not None:
        raise not_supported("Audio output", "audio")
    if "audio" in (request.modalities or []):
        raise not_supported("Audio output", "modalities")

"""`POST /v1/chat/completions`: the request body and the response objects, with OpenAI's names.

Message and part models ignore unknown fields: clients append response messages to the history
as they got them, and those carry response-only fields such as `annotations`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from pagedbatch.protocol.schemas.common import (
    INT32_MAX,
    FreeJSON,
    Name,
    PromptLogprobs,
    SamplingRequest,
    Text,
    Usage,
    prompt_logprobs_field,
)

MAX_TOP_LOGPROBS = 20
# Bounds on what one request may hold (OpenAI's own where it has one: 128 tools, 16 metadata
# pairs of 64-character keys and 512-character values).
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# Content parts.


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


# An image sent inline: base64 of up to 48 MiB, a ceiling above the engine's max_image_bytes
# (20 MiB by default), which is the bound that applies.
MAX_IMAGE_URL_CHARS = 2**26


class ImageURL(BaseModel):
    url: Annotated[str, Field(max_length=MAX_IMAGE_URL_CHARS)]  # http(s) or a data: URL
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(BaseModel):
    data: Text  # base64
    format: Literal["wav", "mp3"]


class AudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FileRef(BaseModel):
    file_id: Name | None = None
    file_data: Text | None = None  # base64
    filename: Name | None = None


class FilePart(BaseModel):
    type: Literal["file"]
    file: FileRef


class RefusalPart(BaseModel):
    type: Literal["refusal"]
    refusal: Text


UserContentPart = Annotated[
    TextPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")
]
AssistantContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]

# Messages.


class FunctionCall(BaseModel):
    name: Name
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class AudioRef(BaseModel):
    id: Name


class InstructionMessage(BaseModel):
    role: Literal["developer", "system"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]
    name: Name | None = None


class UserMessage(BaseModel):
    role: Literal["user"]
    content: Text | Annotated[list[UserContentPart], Field(max_length=MAX_CONTENT_PARTS)]
    name: Name | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: (
        Text | Annotated[list[AssistantContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None
    ) = None
    refusal: Text | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    function_call: FunctionCall | None = None  # deprecated form of tool_calls
    audio: AudioRef | None = None


class ToolMessage(BaseModel):
    role: Literal["tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]
    tool_call_id: Name


class FunctionMessage(BaseModel):  # deprecated form of ToolMessage
    role: Literal["function"]
    content: Text | None
    name: Name


ChatMessage = Annotated[
    InstructionMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
    Field(discriminator="role"),
]

# Tools and response formats, enforced by constrained decoding (engine/sample/structured_output.py).


class FunctionDefinition(BaseModel):
    name: Name
    description: Text | None = None
    parameters: FreeJSON | None = None  # JSON Schema
    strict: bool | None = None


class FunctionTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class CustomToolDefinition(BaseModel):
    name: Name
    description: Text | None = None
    format: FreeJSON | None = None


class CustomTool(BaseModel):
    type: Literal["custom"]
    custom: CustomToolDefinition


Tool = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]


class FunctionName(BaseModel):
    name: Name


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(BaseModel):
    mode: Literal["auto", "required"]
    tools: Annotated[list[FreeJSON], Field(max_length=MAX_TOOLS)]


class AllowedToolsChoice(BaseModel):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = (
    Literal["none", "auto", "required"]
    | Annotated[NamedToolChoice | AllowedToolsChoice, Field(discriminator="type")]
)


class TextFormat(BaseModel):
    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    type: Literal["json_object"]


class JSONSchema(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    # `schema` would shadow a BaseModel attribute.
    json_schema: FreeJSON | None = Field(None, alias="schema")
    strict: bool | None = None


class JSONSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]

# The request.


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)  # deprecated max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: Annotated[list[FunctionDefinition], Field(max_length=MAX_TOOLS)] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None
    modalities: Annotated[list[Literal["text", "audio"]], Field(max_length=2)] | None = None
    audio: FreeJSON | None = None

    # Accepted and not acted on.
    metadata: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
            ],
            Field(max_length=MAX_METADATA_PAIRS),
        ]
        | None
    ) = None
    store: bool | None = None
    service_tier: Name | None = None
    reasoning_effort: Name | None = None
    verbosity: Name | None = None
    prediction: FreeJSON | None = None
    prompt_cache_key: Name | None = None
    safety_identifier: Name | None = None
    web_search_options: FreeJSON | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int, info: ValidationInfo) -> int:
        if not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value


# The response.

FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # UTF-8 bytes of the token; a token may hold part of a character


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ChatCompletionTokenLogprob] | None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # vLLM's: a reasoning model's thinking; left out of other models' answers, as OpenAI's.
    reasoning_content: str | None = Field(None, exclude_if=lambda value: value is None)
    refusal: str | None = None
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    audio: dict[str, Any] | None = None


class Choice(BaseModel):
    index: int
    message: ChatCompletionMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    service_tier: str | None = None
    prompt_logprobs: PromptLogprobs | None = prompt_logprobs_field()  # vLLM's


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int  # the call's position among the choice's calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = Field(None, exclude_if=lambda value: value is None)
    refusal: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChoiceDelta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # only on the last chunk, and only with include_usage
    system_fingerprint: str | None = None
    service_tier: str | None = None

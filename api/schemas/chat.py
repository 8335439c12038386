"""`POST /v1/chat/completions`: the request body and the response objects, with OpenAI's names.

Message and part models ignore unknown fields: clients append response messages to the history
as they got them, and those carry response-only fields such as `annotations`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from pagedbatch.api.schemas.common import SamplingRequest, Usage

MAX_TOP_LOGPROBS = 20

# Content parts.


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str  # http(s) or a data: URL
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(BaseModel):
    data: str  # base64
    format: Literal["wav", "mp3"]


class AudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FileRef(BaseModel):
    file_id: str | None = None
    file_data: str | None = None  # base64
    filename: str | None = None


class FilePart(BaseModel):
    type: Literal["file"]
    file: FileRef


class RefusalPart(BaseModel):
    type: Literal["refusal"]
    refusal: str


UserContentPart = Annotated[
    TextPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")
]
AssistantContentPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]

# Messages.


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AudioRef(BaseModel):
    id: str


class InstructionMessage(BaseModel):
    role: Literal["developer", "system"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(BaseModel):
    role: Literal["user"]
    content: str | list[UserContentPart]
    name: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | list[AssistantContentPart] | None = None
    refusal: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # deprecated form of tool_calls
    audio: AudioRef | None = None


class ToolMessage(BaseModel):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


class FunctionMessage(BaseModel):  # deprecated form of ToolMessage
    role: Literal["function"]
    content: str | None
    name: str


ChatMessage = Annotated[
    InstructionMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
    Field(discriminator="role"),
]

# Tools and response formats, enforced by constrained decoding (engine/structured_output.py).


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema
    strict: bool | None = None


class FunctionTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class CustomToolDefinition(BaseModel):
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None


class CustomTool(BaseModel):
    type: Literal["custom"]
    custom: CustomToolDefinition


Tool = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class AllowedTools(BaseModel):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


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
    description: str | None = None
    # `schema` would shadow a BaseModel attribute.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class JSONSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]

# The request.


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated alias of max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[FunctionDefinition] | None = None  # deprecated form of tools
    function_call: Literal["none", "auto"] | FunctionName | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None

    # Accepted and not acted on.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    web_search_options: dict[str, Any] | None = None

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

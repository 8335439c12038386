"""`POST /v1/responses`: the request body, its input items, and the Response object, with OpenAI's
names and shapes (the `openai` SDK's `openai.types.responses` parses what these write).

Item and part models ignore unknown fields, as chat's messages do: clients send earlier output
items back as input just as they got them, with response-only fields such as `annotations`.
Which of the accepted values are then served (an image for a text-only model, a built-in tool,
an input file that is not text) is decided by serving/responses.py, each refusal a 400 naming
the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from pagedbatch.protocol.schemas.chat import (
    MAX_CONTENT_PARTS,
    MAX_IMAGE_URL_CHARS,
    MAX_MESSAGES,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    InputAudio,
    TopLogprob,
)
from pagedbatch.protocol.schemas.common import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    FreeJSON,
    Name,
    RequestBody,
    Text,
)

# OpenAI's least max_output_tokens.
MIN_OUTPUT_TOKENS = 16

Metadata = Annotated[
    dict[
        Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
        Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
    ],
    Field(max_length=MAX_METADATA_PAIRS),
]

# Content parts of input messages.


class InputTextPart(BaseModel):
    type: Literal["input_text"]
    text: Text


class InputImagePart(BaseModel):
    type: Literal["input_image"]
    image_url: Annotated[str, Field(max_length=MAX_IMAGE_URL_CHARS)] | None = None
    file_id: Name | None = None
    detail: Literal["auto", "low", "high", "original"] = "auto"


class InputAudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class InputFilePart(BaseModel):
    type: Literal["input_file"]
    file_data: Text | None = None  # base64, or a data: URL
    file_id: Name | None = None
    file_url: Text | None = None
    filename: Name | None = None


class OutputTextPart(BaseModel):
    """An earlier answer's text, sent back as input (its annotations and logprobs are not)."""

    type: Literal["output_text"]
    text: Text


class RefusalPart(BaseModel):
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[
    InputTextPart | InputImagePart | InputAudioPart | InputFilePart | OutputTextPart | RefusalPart,
    Field(discriminator="type"),
]
Content = Text | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]

# Input items.


class MessageItem(BaseModel):
    """A message: the easy form `{role, content}`, an input message, or an earlier output
    message (role assistant, `output_text` parts)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: Text  # JSON text, as the model wrote it
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


FunctionOutputPart = Annotated[
    InputTextPart | InputImagePart | InputFilePart, Field(discriminator="type")
]


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: Name
    output: Text | Annotated[list[FunctionOutputPart], Field(max_length=MAX_CONTENT_PARTS)]
    id: Name | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(BaseModel):
    """An earlier answer's thinking, sent back as input: kept in the conversation's items and
    left out of the prompt, as reasoning models' chat templates leave out earlier thinking."""

    type: Literal["reasoning"]
    id: Name | None = None
    summary: Annotated[list[FreeJSON], Field(max_length=MAX_CONTENT_PARTS)] = Field(
        default_factory=list
    )
    content: Annotated[list[ReasoningTextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    encrypted_content: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _typed(item: Any) -> Any:
    # An easy message has no `type`; a message is the one kind that may leave it out.
    if isinstance(item, dict) and "type" not in item:
        return {**item, "type": "message"}
    return item


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
    BeforeValidator(_typed),
]

# Tools, tool choice and the text format.


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: Name
    description: Text | None = None
    parameters: FreeJSON | None = None  # JSON Schema
    strict: bool | None = None


class OtherTool(BaseModel):
    """A tool of another type: OpenAI's built-in tools (web_search, file_search, ...), which
    this server does not run; kept so the refusal can name it."""

    model_config = ConfigDict(extra="allow")

    type: Name


def _tool_type(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "function" if kind == "function" else "other"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
    Discriminator(_tool_type),
]


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: Name


class AllowedToolsChoice(BaseModel):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[FreeJSON], Field(max_length=MAX_TOOLS)]


class OtherToolChoice(BaseModel):
    """A built-in tool named as the choice (`{"type": "web_search_preview"}`): refused."""

    model_config = ConfigDict(extra="allow")

    type: Name


def _choice_type(choice: Any) -> str:
    kind = choice.get("type") if isinstance(choice, dict) else getattr(choice, "type", None)
    return kind if kind in ("function", "allowed_tools") else "other"


ToolChoice = (
    Literal["none", "auto", "required"]
    | Annotated[
        Annotated[FunctionToolChoice, Tag("function")]
        | Annotated[AllowedToolsChoice, Tag("allowed_tools")]
        | Annotated[OtherToolChoice, Tag("other")],
        Discriminator(_choice_type),
    ]
)


class TextFormat(BaseModel):
    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    type: Literal["json_object"]


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    # `schema` would shadow a BaseModel attribute.
    json_schema: FreeJSON = Field(alias="schema")
    strict: bool | None = None


TextFormatConfig = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormatConfig = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not acted on


class Reasoning(BaseModel):
    """A reasoning model's effort (see chat's `reasoning_effort`); a 400 for other models."""

    model_config = ConfigDict(extra="forbid")

    effort: Name | None = None
    summary: Name | None = None
    generate_summary: Name | None = None  # deprecated `summary`


class ResponseReasoning(BaseModel):
    effort: str | None = None
    summary: str | None = None


class ResponseStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_obfuscation: bool = True  # accepted; the stream is not obfuscated


# What `include` may ask for; only the output text's logprobs are something a model here makes,
# the rest concern built-in tools and reasoning, which have nothing to include.
Includable = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
]
OUTPUT_LOGPROBS: Includable = "message.output_text.logprobs"

# The request.


class ResponseCreateRequest(RequestBody):
    model: str
    input: Text | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] | None = None
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=MIN_OUTPUT_TOKENS, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    metadata: Metadata | None = None
    user: Name | None = None
    store: bool = True
    previous_response_id: Name | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    include: Annotated[list[Includable], Field(max_length=len(Includable.__args__))] | None = None
    background: bool = False
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    reasoning: Reasoning | None = None
    # vLLM's extension, as on chat: sampling that a seed makes repeatable.
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)

    # Accepted and not acted on.
    service_tier: Name | None = None
    prompt_cache_key: Name | None = None
    safety_identifier: Name | None = None


# The response.


class Logprob(TopLogprob):
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[Logprob] = Field(default_factory=list)


class OutputRefusal(BaseModel):
    type: Literal["refusal"] = "refusal"
    refusal: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText | OutputRefusal]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's thinking, before its message (OpenAI's reasoning item; the text as
    `content`, as vLLM gives it; no summary)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[OutputReasoningText]
    status: ItemStatus


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str  # OpenAI's: server_error, rate_limit_exceeded, invalid_prompt, ...
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    background: bool
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ResponseReasoning
    service_tier: str = "default"
    store: bool
    temperature: float
    text: TextConfig
    tool_choice: ToolChoice
    tools: list[Tool]
    top_logprobs: int
    top_p: float
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]
    completed_at: int | None = None

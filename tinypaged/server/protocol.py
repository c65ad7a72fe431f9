"""The HTTP schema, OpenAI's names and shapes, as msgspec Structs: decoding a request validates it. The chat
messages and tools a request carries are in messages.py.

Field constraints live in the types (`Annotated[..., Meta(...)]`) so that `/openapi.json` shows them and a bad
value fails with msgspec's path to the field. Cross-field rules and limits are the engine's (SamplingParams,
`LLMEngine.process_inputs`); the HTTP API's own rules are checked in serving.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from tinypaged import limits  # the engine's limits, shown in /openapi.json (docs/limits.md)
from tinypaged.limits import MAX_LOGPROBS
from tinypaged.server.messages import ChatMessage, Tool, ToolCall, ToolChoice

Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=limits.PENALTY[0], le=limits.PENALTY[1])]
TokenId = Annotated[int, Meta(ge=0)]
StopString = Annotated[str, Meta(max_length=limits.MAX_STOP_STRING_CHARS)]


class StreamOptions(Struct, forbid_unknown_fields=True):
    """`stream_options`: whether a last chunk carries the request's usage."""

    include_usage: bool = False


class JsonSchemaSpec(Struct):
    """`response_format.json_schema`: the schema the output follows (always enforced, `strict` or not)."""

    name: Annotated[str, Meta(max_length=64)]
    schema: dict[str, Any] | None = None  # none: any JSON object
    description: str | None = None
    strict: bool | None = None


class TextFormat(Struct, tag_field="type", tag="text"):
    """`response_format: {"type": "text"}`: free text (the default)."""


class JsonObjectFormat(Struct, tag_field="type", tag="json_object"):
    """`response_format: {"type": "json_object"}`: any JSON object."""


class JsonSchemaFormat(Struct, tag_field="type", tag="json_schema"):
    """`response_format: {"type": "json_schema", "json_schema": {...}}`: JSON following the schema."""

    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StructuredOutputs(Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` extra parameter: exactly one of json (a schema), regex, choice, grammar (Lark
    or GBNF), json_object; JSON's whitespace: one space after `:` and `,` unless disable_any_whitespace or
    whitespace_pattern. Limits: docs/limits.md."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(max_length=limits.MAX_CHOICES)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


class _SamplingFields(Struct, kw_only=True):
    """The sampling parameters both endpoints share (OpenAI's, plus vLLM's extras)."""

    model: str | None = None
    n: Annotated[int, Meta(ge=1)] = 1
    best_of: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=limits.TEMPERATURE[0], le=limits.TEMPERATURE[1])] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    min_p: Probability = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[
        float, Meta(ge=limits.REPETITION_PENALTY[0], le=limits.REPETITION_PENALTY[1])
    ] = 1.0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=limits.MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=limits.MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: Annotated[float, Meta(ge=limits.LENGTH_PENALTY[0], le=limits.LENGTH_PENALTY[1])] = 1.0
    early_stopping: bool | Literal["never"] = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/completions`: prompt as a string, a list of strings, token ids or lists of token ids."""

    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: Annotated[int, Meta(ge=1)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """`POST /v1/chat/completions`: messages rendered through the model's chat template (with `tools`)."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Meta(max_length=limits.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


class UsageInfo(Struct):
    """Token counts of one request (every prompt and choice)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Struct):
    """The legacy completions logprobs: parallel lists over the choice's tokens."""

    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(Struct):
    """One choice of a completion (a whole one, or a stream chunk's delta)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(Struct):
    """The body of a completion, or one SSE chunk of a streamed one (then `usage` is null but in the last)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"


class TopLogprob(Struct):
    """One alternative token in the chat logprobs format."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(Struct):
    """One generated token in the chat logprobs format, with its top alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChatLogprobs(Struct):
    """`choices[i].logprobs` of a chat completion."""

    content: list[ChatTokenLogprob] = msgspec.field(default_factory=list)


class ChatResponseMessage(Struct):
    """The assistant's message of a chat choice: its text (null when it is only tool calls) and tool calls."""

    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ChatChoice(Struct):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Struct):
    """The body of a chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"


class DeltaFunctionCall(Struct, omit_defaults=True):
    """A piece of a streamed tool call's function: its name in the call's first delta, then its arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A piece of tool call `index` of a streamed message (its id and type in its first delta)."""

    index: int
    function: DeltaFunctionCall
    id: str | None = None
    type: Literal["function"] | None = None


class DeltaMessage(Struct, omit_defaults=True):
    """What one chunk adds to a streamed chat message (the role in the first only)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    """One choice's delta in a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Struct):
    """One SSE chunk of a streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"


class ModelCard(Struct):
    """One served model."""

    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "tinypaged"


class ModelList(Struct):
    """`GET /v1/models`."""

    data: list[ModelCard]
    object: str = "list"


class TokenizeRequest(Struct, kw_only=True):
    """`POST /tokenize`: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(Struct):
    """Token ids of a prompt and how many fit."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Struct, kw_only=True):
    """`POST /detokenize`."""

    tokens: list[TokenId]
    model: str | None = None


class DetokenizeResponse(Struct):
    """The text of the token ids."""

    prompt: str


class VersionResponse(Struct):
    """`GET /version`."""

    version: str


class ErrorInfo(Struct):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    """Every error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# (method, path, request type, response type, summary): the routes /openapi.json describes.
ROUTES: list[tuple[str, str, type | None, type | None, str]] = [
    (
        "post",
        "/v1/completions",
        CompletionRequest,
        CompletionResponse,
        "Create a completion (SSE when stream)",
    ),
    (
        "post",
        "/v1/chat/completions",
        ChatCompletionRequest,
        ChatCompletionResponse,
        "Create a chat completion",
    ),
    ("get", "/v1/models", None, ModelList, "List the served model"),
    ("post", "/tokenize", TokenizeRequest, TokenizeResponse, "Tokenize a prompt or chat messages"),
    ("post", "/detokenize", DetokenizeRequest, DetokenizeResponse, "Decode token ids"),
    ("get", "/version", None, VersionResponse, "The server's version"),
    ("get", "/health", None, None, "200 while the engine serves, 503 otherwise"),
    ("get", "/metrics", None, None, "Prometheus text format"),
]


def openapi_schema(version: str) -> dict:
    """The OpenAPI 3.1 document of ROUTES, its schemas generated from the Structs above."""
    types = [t for _, _, req, resp, _ in ROUTES for t in (req, resp) if t is not None]
    types += [ErrorResponse, ChatCompletionChunk]
    refs, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    ref = dict(zip(types, refs, strict=True))
    error = {"description": "error", "content": {"application/json": {"schema": ref[ErrorResponse]}}}
    paths: dict[str, dict] = {}
    for method, path, req, resp, summary in ROUTES:
        ok: dict = {"description": "OK"}
        if resp is not None:
            ok["content"] = {"application/json": {"schema": ref[resp]}}
        op: dict = {"summary": summary, "responses": {"200": ok}}
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[req]}}}
            op["responses"].update(
                {code: error for code in ("400", "401", "404", "408", "413", "415", "503")}
            )
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "tinypaged", "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }

"""Chat messages and tools as OpenAI's schema has them, as msgspec Structs: the vocabulary of a chat request's
`messages`, `tools` and `tool_choice` (server/protocol.py's ChatCompletionRequest and TokenizeRequest) and of an
assistant's tool calls (its responses)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

# Chat messages as OpenAI's schema has them: one Struct per role, told apart by `role` (a tagged union), each
# with its own required fields; content is a string or a non-empty list of parts, told apart by `type`.


class TextPart(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """A text part of a message's content."""

    text: str


class RefusalPart(Struct, tag_field="type", tag="refusal", forbid_unknown_fields=True):
    """A refusal part of an assistant message's content."""

    refusal: str


class ImageURL(Struct):
    """The image of an `image_url` part."""

    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(Struct, tag_field="type", tag="image_url"):
    """An image part of a user message (in the schema, refused by a text-only model)."""

    image_url: ImageURL


class InputAudio(Struct):
    """The audio of an `input_audio` part."""

    data: str
    format: Literal["wav", "mp3"]


class AudioPart(Struct, tag_field="type", tag="input_audio"):
    """An audio part of a user message (in the schema, refused by a text-only model)."""

    input_audio: InputAudio


class FileRef(Struct):
    """The file of a `file` part: an uploaded file's id or its data."""

    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None


class FilePart(Struct, tag_field="type", tag="file"):
    """A file part of a user message (in the schema, refused by a text-only model)."""

    file: FileRef


TextContent = str | Annotated[list[TextPart], Meta(min_length=1)]
UserContent = str | Annotated[list[TextPart | ImagePart | AudioPart | FilePart], Meta(min_length=1)]
AssistantContent = str | Annotated[list[TextPart | RefusalPart], Meta(min_length=1)]


class FunctionCall(Struct):
    """A function the model called: its name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(Struct):
    """One tool call of an assistant message."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class SystemMessage(Struct, tag_field="role", tag="system"):
    """Instructions to the model."""

    content: TextContent
    name: str | None = None


class DeveloperMessage(Struct, tag_field="role", tag="developer"):
    """Instructions to the model (the newer name of a system message)."""

    content: TextContent
    name: str | None = None


class UserMessage(Struct, tag_field="role", tag="user"):
    """What the user said."""

    content: UserContent
    name: str | None = None


class AssistantMessage(Struct, tag_field="role", tag="assistant"):
    """What the model said before; `content` may be left out only when it called tools or a function."""

    content: AssistantContent | None = None
    refusal: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None


class ToolMessage(Struct, tag_field="role", tag="tool"):
    """A tool's answer to the tool call `tool_call_id`."""

    content: TextContent
    tool_call_id: str


class FunctionMessage(Struct, tag_field="role", tag="function"):
    """A function's answer (deprecated by OpenAI in favour of tool messages); `content` is required, may be null."""

    content: str | None
    name: str


ChatMessage = (
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage
)


class FunctionDefinition(Struct):
    """A function the model may call: its name, what it does, and its parameters' JSON schema."""

    name: Annotated[str, Meta(pattern="^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    """One tool of `tools`."""

    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(Struct):
    """The function a named `tool_choice` calls."""

    name: str


class NamedToolChoice(Struct):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: the model calls this function."""

    function: FunctionName
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

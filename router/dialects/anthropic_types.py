"""Anthropic Messages API request bodies: `POST /v1/messages` and its `count_tokens`.

Strict types and unknown fields ignored, as router.edge.openai_types. A content block of a type
this pool does not serve (image, document, thinking, ...) parses as `UnservedBlock`, so the
translation (router.dialects.anthropic_request) refuses it with a 400 that names it, rather
than a union error that lists every block type it is not.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from router.edge.openai_types import JSONObject, Text


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Body):
    type: Literal["text"]
    text: Text


class ToolUseBlock(_Body):
    """An assistant's tool call, as the client sends it back."""

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: JSONObject


class UnservedBlock(_Body):
    """Any other block type: parsed only to be refused by name."""

    type: Text


def _tag(served: frozenset[str]) -> Any:
    """The union member of a block: its own type when served there, else `unserved`."""

    def tag(block: Any) -> str:
        kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
        return kind if kind in served else "unserved"

    return Discriminator(tag)


# A tool result's own content: text blocks (anything else is refused by name).
ResultBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[UnservedBlock, Tag("unserved")],
    _tag(frozenset({"text"})),
]


class ToolResultBlock(_Body):
    """A user's answer to a tool_use, by its id; `is_error`: the tool failed."""

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[ResultBlock] | None = None
    is_error: bool | None = None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[UnservedBlock, Tag("unserved")],
    _tag(frozenset({"text", "tool_use", "tool_result"})),
]


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class Tool(_Body):
    """A client tool; server tools (web search, code execution, ...) have a `type` of their own
    and are refused."""

    name: Text = Field(min_length=1)
    description: Text | None = None
    input_schema: JSONObject
    type: Literal["custom"] | None = None


class _ChoiceBody(_Body):
    disable_parallel_tool_use: bool | None = None


class AutoChoice(_ChoiceBody):
    type: Literal["auto"]


class AnyChoice(_ChoiceBody):
    type: Literal["any"]


class NamedChoice(_ChoiceBody):
    type: Literal["tool"]
    name: Text


class NoneChoice(_ChoiceBody):
    type: Literal["none"]


ToolChoice = Annotated[
    AutoChoice | AnyChoice | NamedChoice | NoneChoice, Field(discriminator="type")
]


class CountTokensRequest(_Body):
    """What a prompt is made of: the body of count_tokens, and the start of every request."""

    model: Text
    system: Text | list[TextBlock] | None = None
    messages: list[InputMessage]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # A vendor extension (not Anthropic's): the request's own chat template, where the pool's
    # operator allows one (MLXCEL_TRUST_REQUEST_CHAT_TEMPLATE), as on chat completions.
    chat_template: Text | None = None


class CreateMessageRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    stream: bool | None = False
    # Accepted and ignored: the pool keeps no per-user state.
    metadata: dict[Text, Any] | None = None

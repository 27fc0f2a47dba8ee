"""OpenAI's Responses API request, and its translation into the chat request the pool serves.

A Responses request is a chat request in other words: `input` items become chat messages
(`function_call` -> an assistant message's `tool_calls`, `function_call_output` -> a `tool`
message), `instructions` a leading system message, the flat function `tools` chat's nested ones,
`text.format` chat's `response_format`. The translated `ChatCompletionRequest` goes through the
same admission, placement and relay as `/v1/chat/completions`, so every check, limit and error
of chat applies unchanged. Fields that ask for what this pool does not serve (built-in tools,
`background`, reasoning effort, `include`, `truncation: "auto"`, ...) are a 400 naming the field,
never ignored.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.edge.errors import APIError, validation_failure
from router.edge.openai_types import JSONObject, Text
from shared.errors import ErrorKind

# A chat message as the stored conversation and ChatCompletionRequest hold it.
Message = dict[str, Any]


class _Body(BaseModel):
    # Strict types, unknown fields ignored: router.edge.openai_types' rule for every request.
    model_config = ConfigDict(extra="ignore", strict=True)


class ResponsesRequest(_Body):
    model: Text | None = None
    input: Text | list[JSONObject] | None = None
    instructions: Text | None = None
    tools: list[JSONObject] | None = None
    tool_choice: Literal["none", "auto", "required"] | JSONObject | None = None
    parallel_tool_calls: bool | None = None
    text: JSONObject | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: Text | None = None
    metadata: dict[Text, Text] | None = None
    user: Text | None = None
    prompt_cache_key: Text | None = None
    # Extensions, passed to the chat request as they are.
    chat_template: Text | None = None
    chat_template_kwargs: JSONObject | None = None
    # Served only at the values that ask for nothing more (refuse_unserved).
    background: bool | None = None
    reasoning: JSONObject | None = None
    include: list[Text] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Text | JSONObject | None = None
    prompt: JSONObject | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    @property
    def stored(self) -> bool:
        return self.store is not False


def invalid(message: str, param: str | None) -> APIError:
    return APIError.of(ErrorKind.INVALID_REQUEST, message, param)


def _shown(value: Any, limit: int = 100) -> str:
    """A client's value quoted in an error message, cut short (an error never echoes megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def refuse_unserved(body: ResponsesRequest) -> None:
    """A field asking for something this pool does not do is a 400, never silently ignored."""
    if body.background:
        raise invalid(
            "'background' responses are not served: send background: false.", "background"
        )
    reasoning = body.reasoning or {}
    if reasoning.get("effort") not in (None, "none") or reasoning.get("summary") is not None:
        raise invalid(
            "'reasoning' is not served: this pool's models have no reasoning effort or summary.",
            "reasoning",
        )
    if body.include:
        raise invalid(
            f"'include' asks for {_shown(body.include)}, which this pool does not serve.", "include"
        )
    if body.truncation == "auto":
        raise invalid("Only 'truncation': 'disabled' is served.", "truncation")
    if body.conversation is not None:
        raise invalid(
            "'conversation' is not served; continue a conversation with 'previous_response_id'.",
            "conversation",
        )
    if body.prompt is not None:
        raise invalid("Stored prompt templates ('prompt') are not served.", "prompt")
    if body.top_logprobs:
        raise invalid("'top_logprobs' is not served on /v1/responses.", "top_logprobs")
    if body.max_tool_calls is not None:
        raise invalid(
            "'max_tool_calls' is not served; use 'parallel_tool_calls'.", "max_tool_calls"
        )
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise invalid(
            f"'max_output_tokens' must be at least 1, got {body.max_output_tokens}.",
            "max_output_tokens",
        )
    if body.input is None:
        raise invalid("'input' is required.", "input")


# --- items ---------------------------------------------------------------------------------------


class FunctionTool(_Body):
    type: Literal["function"]
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[JSONObject]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: Text = Field(min_length=1)
    arguments: Text


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: Text | list[JSONObject]


ITEM_TYPES: dict[str, type[_Body]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}
# Parts that carry text; images, files and audio are not served (text models).
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
# A reasoning item a client echoes back: this pool writes none, and it renders as nothing.
DROPPED_ITEMS = {"reasoning"}

M = TypeVar("M", bound=BaseModel)


def parse_as(model: type[M], value: dict[str, Any], where: tuple[str | int, ...]) -> M:
    """`value` as `model`, or the 400 naming the field inside it (`input.2.call_id`)."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *where, *e["loc"])} for e in exc.errors()]
        message, param = validation_failure(errors)
        raise invalid(message, param) from None


def _text_of(parts: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(parts, str):
        return parts
    out = []
    for i, part in enumerate(parts):
        kind = part.get("type")
        field = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if field is None:
            raise invalid(
                f"'{where}.{i}.type' is {_shown(kind)}: only text parts "
                f"({', '.join(TEXT_PARTS)}) are served.",
                f"{where}.{i}.type",
            )
        text = part.get(field)
        if not isinstance(text, str):
            raise invalid(f"'{where}.{i}.{field}' must be a string.", f"{where}.{i}.{field}")
        out.append(text)
    return "".join(out)


def input_messages(body: ResponsesRequest) -> list[Message]:
    """The request's `input` as chat messages (instructions not included)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    return items_to_messages(body.input or [], "input")


def items_to_messages(items: list[dict[str, Any]], where: str) -> list[Message]:
    """Responses items as chat messages: a function_call joins the assistant message before it
    (the calls of one turn are one message, as the chat template expects)."""
    out: list[Message] = []
    for i, raw in enumerate(items):
        kind = raw.get("type", "message" if "role" in raw else None)
        named = isinstance(kind, str)  # any JSON value may come: a list or object names nothing
        if named and kind in DROPPED_ITEMS:
            continue
        model = ITEM_TYPES.get(kind) if named else None
        if model is None:
            raise invalid(
                f"'{where}.{i}.type' is {_shown(kind)}: served item types are "
                f"{', '.join(ITEM_TYPES)}.",
                f"{where}.{i}.type",
            )
        item = parse_as(model, raw, (where, i))
        if isinstance(item, MessageItem):
            text = _text_of(item.content, f"{where}.{i}.content")
            out.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            text = _text_of(item.output, f"{where}.{i}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    return out


# --- tools and formats ---------------------------------------------------------------------------


def chat_tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The flat function tools in chat's nested shape; a built-in tool is a 400."""
    if body.tools is None:
        return None
    out = []
    for i, raw in enumerate(body.tools):
        if raw.get("type") != "function":
            raise invalid(
                f"'tools.{i}' is a {_shown(raw.get('type'))} tool: only function tools are served "
                "(built-in tools such as web_search, file_search, computer use, code "
                "interpreter, MCP or image generation are not).",
                f"tools.{i}.type",
            )
        tool = parse_as(FunctionTool, raw, ("tools", i))
        out.append(
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        )
    return out


def chat_tool_choice(body: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise invalid(
            "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
            '"name": ...}.',
            "tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


def response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (structured output compiles it)."""
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("'text.format' must be an object.", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(
        f"'text.format.type' is {_shown(kind)}: served are text, json_schema and json_object.",
        "text.format.type",
    )


def chat_body(body: ResponsesRequest, conversation: list[Message]) -> dict[str, Any]:
    """The chat request (as JSON) for `conversation`, the earlier turns and this input."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": system + conversation,
        "tools": chat_tools(body),
        "tool_choice": chat_tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
        "prompt_cache_key": body.prompt_cache_key,
        "chat_template": body.chat_template,
        "chat_template_kwargs": body.chat_template_kwargs,
        "stream": bool(body.stream),
    }
    return {k: v for k, v in fields.items() if v is not None}


# The chat request's names in an admission error, as this API names them.
PARAM_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


def in_responses_terms(err: APIError) -> APIError:
    """An admission error of the translated chat request, naming this API's fields."""
    if err.param is not None:
        head = err.param.split(".")[0].split("[")[0]
        if head in PARAM_NAMES:
            err.param = PARAM_NAMES[head]
    for chat, ours in PARAM_NAMES.items():
        err.message = err.message.replace(f"'{chat}'", f"'{ours}'")
    return err

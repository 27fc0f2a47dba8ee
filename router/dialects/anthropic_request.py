"""A Messages API request as the router's chat request (router.edge.openai_types), so admission,
placement and the relay serve it as they serve chat completions.

system -> a system message; a user's text blocks -> user messages and each tool_result -> a
tool message (in the order sent); an assistant's text -> its content and its tool_use blocks ->
its tool_calls; tools -> function tools; tool_choice any -> "required", tool -> the named
function, none -> "none"; disable_parallel_tool_use -> parallel_tool_calls false;
stop_sequences -> stop. A block type this pool does not serve is a 400 naming it.
"""

from __future__ import annotations

import json

from router.admission.admit import MAX_STOP_SEQUENCES
from router.dialects.anthropic_types import (
    AnyChoice,
    AutoChoice,
    CountTokensRequest,
    CreateMessageRequest,
    InputMessage,
    NamedChoice,
    NoneChoice,
    ResultBlock,
    TextBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    UnservedBlock,
)
from router.edge.errors import APIError
from router.edge.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionSpec,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolSpec,
)
from shared.errors import ErrorKind

# What a tool result with `is_error: true` starts with in the prompt: chat templates have no
# field for a failed tool, so the model reads it in the text.
TOOL_ERROR_PREFIX = "Error: "


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that renders the same prompt and samples the same way."""
    messages = _system(body)
    for i, message in enumerate(body.messages):
        messages += _messages(i, message)
    fields: dict[str, object] = {}
    if isinstance(body, CreateMessageRequest):
        stops = body.stop_sequences or []
        if len(stops) > MAX_STOP_SEQUENCES:  # admission would name chat's field, `stop`
            raise APIError.of(
                ErrorKind.INVALID_REQUEST,
                f"'stop_sequences' may hold at most {MAX_STOP_SEQUENCES} sequences.",
                "stop_sequences",
            )
        fields = {
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences,
            "stream": bool(body.stream),
        }
    choice = body.tool_choice
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        chat_template=body.chat_template,
        tools=[_tool(t) for t in body.tools] if body.tools else None,
        tool_choice=_tool_choice(choice),
        parallel_tool_calls=False if choice and choice.disable_parallel_tool_use else None,
        **fields,
    )


def _unserved(kind: str, where: str, served: str = "text, tool_use and tool_result") -> APIError:
    return APIError.of(
        ErrorKind.INVALID_REQUEST,
        f"'{where}' is a content block of type {kind!r}, which this pool does not serve "
        f"there (it serves {served} blocks).",
        where,
    )


def _system(body: CountTokensRequest) -> list[ChatMessage]:
    if body.system is None:
        return []
    return [ChatMessage(role="system", content=_text(body.system))]


def _text(content: str | list[TextBlock]) -> str:
    """Text blocks joined as the chat route joins text parts."""
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _messages(i: int, message: InputMessage) -> list[ChatMessage]:
    where = f"messages.{i}.content"
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    for j, block in enumerate(message.content):
        if isinstance(block, UnservedBlock):
            raise _unserved(block.type, f"{where}.{j}")
        wrong = ToolUseBlock if message.role == "user" else ToolResultBlock
        if isinstance(block, wrong):
            raise APIError.of(
                ErrorKind.INVALID_REQUEST,
                f"'{where}.{j}': a {block.type} block cannot be in a {message.role} message.",
                f"{where}.{j}",
            )
    if message.role == "assistant":
        return [_assistant(message)]
    return _user(message, where)


def _assistant(message: InputMessage) -> ChatMessage:
    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
    calls = [
        ToolCall(
            id=b.id,
            function=FunctionCall(name=b.name, arguments=json.dumps(b.input, ensure_ascii=False)),
        )
        for b in message.content
        if isinstance(b, ToolUseBlock)
    ]
    if not calls:
        return ChatMessage(role="assistant", content=text)
    return ChatMessage(role="assistant", content=text or None, tool_calls=calls)


def _user(message: InputMessage, where: str) -> list[ChatMessage]:
    """Runs of text blocks as user messages, each tool_result as a tool message, in order."""
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
            continue
        assert isinstance(block, ToolResultBlock)  # _messages refused every other kind
        if texts:
            out.append(ChatMessage(role="user", content="".join(texts)))
            texts = []
        content = _result_text(block.content, f"{where}.{j}.content")
        if block.is_error:
            content = TOOL_ERROR_PREFIX + content
        out.append(ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id))
    if texts or not out:
        out.append(ChatMessage(role="user", content="".join(texts)))
    return out


def _result_text(content: str | list[ResultBlock] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for k, block in enumerate(content):
        if isinstance(block, UnservedBlock):
            raise _unserved(block.type, f"{where}.{k}", "text")
    return "".join(b.text for b in content if isinstance(b, TextBlock))


def _tool(tool: Tool) -> ToolSpec:
    spec = FunctionSpec(name=tool.name, description=tool.description, parameters=tool.input_schema)
    return ToolSpec(type="function", function=spec)


def _tool_choice(choice: ToolChoice | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, AutoChoice):
        return None if choice is None else "auto"
    if isinstance(choice, AnyChoice):
        return "required"
    if isinstance(choice, NoneChoice):
        return "none"
    assert isinstance(choice, NamedChoice)
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))

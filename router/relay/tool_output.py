"""A chat request's tool calls in its output: the splitter of each choice's text into content
and calls, when the template's tool-call format is known."""

from __future__ import annotations

from collections.abc import Callable

from router.admission.admit import AdmissionContext, chat_tools
from router.admission.tool_calls import ToolCallStream
from router.edge.openai_types import ChatCompletionRequest


def tool_streams(
    ctx: AdmissionContext, body: ChatCompletionRequest
) -> Callable[[], ToolCallStream] | None:
    """Blocking (the first use of a parser loads it): admission's thread calls it, once the
    request's tools are checked. None: the template has no tool-call format mlx-lm knows, so the
    output is all content."""
    parser = ctx.tokenizer.tool_parser(body.chat_template)
    if parser is None:
        return None
    tools = chat_tools(body)
    max_calls = 1 if body.parallel_tool_calls is False else None  # the first call only
    return lambda: ToolCallStream(parser, tools, max_calls)

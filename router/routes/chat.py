"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Callable

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.admission import admit_chat, chat_tools
from router.openai_types import ChatCompletionRequest, ResponseFormat
from router.routes.generation import admit_and_submit, respond
from router.state import RouterState, StateDep
from router.tool_calls import ToolCallStream

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: StateDep
) -> Response:
    gens = (await admit_and_submit(admit_chat, body, state)).requests
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    fmt = ResponseFormat(chat=True, model=gens[0].model)
    tool_streams = None
    if body.tools and body.tool_choice != "none":
        tool_streams = await anyio.to_thread.run_sync(_tool_streams, state, body, gens[0].model)
    return await respond(request, state, gens, fmt, bool(body.stream), include_usage, tool_streams)


def _tool_streams(
    state: RouterState, body: ChatCompletionRequest, model: str
) -> Callable[[], ToolCallStream] | None:
    """Blocking (the first use of a parser loads it). None: the template has no tool-call format
    mlx-lm knows, so the output is all content. Admission already checked the tools."""
    ctx = state.catalog.get(model)  # admission loaded it: found without a Redis read
    parser = ctx.tokenizer.tool_parser(body.chat_template) if ctx is not None else None
    if parser is None:
        return None
    tools = chat_tools(body)
    max_calls = 1 if body.parallel_tool_calls is False else None  # the first call only
    return lambda: ToolCallStream(parser, tools, max_calls)

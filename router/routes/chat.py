"""POST /v1/chat/completions."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.admission.admit import admit_chat
from router.edge.openai_types import ChatCompletionRequest, ResponseFormat
from router.relay.openai_render import respond
from router.relay.submit import admit_and_submit
from router.relay.tool_output import tool_streams
from router.state import StateDep

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: StateDep
) -> Response:
    routed = await admit_and_submit(admit_chat, body, state)
    routed.fmt = ResponseFormat(chat=True, model=routed.model)
    routed.stream = bool(body.stream)
    routed.include_usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.tools and body.tool_choice != "none":
        routed.tool_streams = await anyio.to_thread.run_sync(
            tool_streams, state, body, routed.model
        )
    return await respond(request, state, routed)

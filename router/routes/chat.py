"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.edge.json_body import JSONBodyRoute
from router.edge.openai_types import ChatCompletionRequest, ResponseFormat
from router.relay.openai_render import respond
from router.relay.submit import submit_chat
from router.state import StateDep

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: StateDep
) -> Response:
    routed = await submit_chat(body, state)
    routed.fmt = ResponseFormat(chat=True, model=routed.model)
    routed.include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await respond(request, state, routed)

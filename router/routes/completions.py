"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.admission.admit import admit_completion
from router.edge.json_body import JSONBodyRoute
from router.edge.openai_types import CompletionRequest, ResponseFormat
from router.relay.openai_render import respond
from router.relay.submit import admit_and_submit
from router.state import StateDep

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    routed = await admit_and_submit(admit_completion, body, state)
    routed.fmt = ResponseFormat(chat=False, model=routed.model)
    routed.stream = bool(body.stream)
    routed.include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await respond(request, state, routed)

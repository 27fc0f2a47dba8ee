"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.admission import admit_completion
from router.openai_types import CompletionRequest, ResponseFormat
from router.routes.generation import admit_and_submit, respond
from router.state import StateDep

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    admission = await admit_and_submit(admit_completion, body, state)
    gens = admission.requests
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    fmt = ResponseFormat(chat=False, model=gens[0].model)
    return await respond(
        request, state, gens, fmt, bool(body.stream), include_usage, echo=admission.echo
    )

"""POST /v1/completions."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.admission import Outcome, admit_completion
from router.openai_types import CompletionRequest, ResponseFormat
from router.routes.generation import respond
from router.state import StateDep

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, state: StateDep) -> Response:
    admission = await anyio.to_thread.run_sync(admit_completion, body, state.admission)
    if admission.outcome is not Outcome.ADMIT or admission.request is None:
        raise admission.error()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    fmt = ResponseFormat(chat=False, model=state.model_id)
    return await respond(request, state, admission.request, fmt, body.stream, include_usage)

"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}: OpenAI's Responses API
(router.dialects)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.dialects import responses_service
from router.dialects.responses import ResponsesRequest
from router.edge.json_body import JSONBodyRoute
from router.routes.probe import get_and_head
from router.state import StateDep

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, state: StateDep) -> Response:
    return await responses_service.create(request, state, body)


@get_and_head(router, "/v1/responses/{response_id}")
async def get_response(response_id: str, state: StateDep) -> dict[str, Any]:
    return await responses_service.retrieve(state, response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: StateDep) -> dict[str, Any]:
    return await responses_service.delete(state, response_id)

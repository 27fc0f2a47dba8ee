"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API
(router.dialects.anthropic_service); its errors leave in Anthropic's shape (router.edge.errors
asks router.dialects.anthropic_errors)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.dialects.anthropic_service import count_tokens, create_message
from router.dialects.anthropic_types import CountTokensRequest, CreateMessageRequest
from router.edge.json_body import JSONBodyRoute
from router.state import StateDep

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/messages")
async def messages(body: CreateMessageRequest, request: Request, state: StateDep) -> Response:
    return await create_message(body, request, state)


@router.post("/v1/messages/count_tokens")
async def messages_count_tokens(body: CountTokensRequest, state: StateDep) -> dict[str, Any]:
    return await count_tokens(body, state)

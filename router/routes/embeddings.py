"""POST /v1/embeddings: admit and enqueue (router/relay/embeddings.py), wait for the worker's
vectors, answer in OpenAI's shape, as floats or as base64 of little-endian float32 (what the
openai SDK asks for and decodes)."""

from __future__ import annotations

import base64
from typing import Any

import anyio
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from router.edge.embedding_types import EmbeddingBody
from router.edge.json_body import JSONBodyRoute
from router.relay.embeddings import embedding_reply, submit_embeddings
from router.state import StateDep
from shared.embedding_wire import EmbeddingReply, floats_of

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingBody, request: Request, state: StateDep) -> Response:
    req = await anyio.to_thread.run_sync(submit_embeddings, body, state)
    reply = await embedding_reply(state, req, request.is_disconnected)
    # orjson directly: FastAPI's encoder would walk every float of every vector.
    return Response(
        orjson.dumps(render(reply, req.model, body.encoding_format)), media_type="application/json"
    )


def render(reply: EmbeddingReply, model: str, encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings list object for the worker's vectors, in input order."""
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": (
                base64.b64encode(raw).decode("ascii")
                if encoding_format == "base64"
                else floats_of(raw)
            ),
        }
        for i, raw in enumerate(reply.embeddings)
    ]
    usage = {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}

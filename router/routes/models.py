"""GET /v1/models and /v1/models/{id}: the router's own model, and every other one a live
worker serves that this router can serve too (router/pool_view/model_catalog.py). A live model
this router refuses (its files are not on this host) is not listed, as vLLM lists only what it
serves; asked for by id it is the same 503 its requests get, not a 404."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter

from router.admission.admit import quoted
from router.edge.errors import APIError
from router.pool_view.model_catalog import unservable_error
from router.routes.probe import get_and_head
from router.state import RouterState, StateDep
from shared.errors import ErrorKind

router = APIRouter()


def _model_object(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mlxcel"}


def _served(state: RouterState) -> list[dict[str, Any]]:
    live = state.catalog.listed()
    out = [_model_object(state.model_id, state.model_created)]
    for model_id in sorted(m for m in live if m != state.model_id):
        out.append(_model_object(model_id, live[model_id].created))
    return out


@get_and_head(router, "/v1/models")
async def list_models(state: StateDep) -> dict[str, Any]:
    return {"object": "list", "data": await anyio.to_thread.run_sync(_served, state)}


@get_and_head(router, "/v1/models/{model_id:path}")
async def get_model(model_id: str, state: StateDep) -> dict[str, Any]:
    for model in await anyio.to_thread.run_sync(_served, state):
        if model["id"] == model_id:
            return model
    refused = state.catalog.refusal(model_id)
    if refused is not None:
        raise unservable_error(model_id, refused)
    message = f"The model {quoted(model_id)} does not exist."
    raise APIError.of(ErrorKind.UNKNOWN_MODEL, message, param="model")

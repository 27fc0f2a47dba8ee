"""GET /v1/models: the one model this pool serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from router.state import RouterState, StateDep

router = APIRouter()


def _model_object(state: RouterState) -> dict[str, Any]:
    return {
        "id": state.model_id,
        "object": "model",
        "created": state.model_created,
        "owned_by": "mlxcel",
    }


@router.get("/v1/models")
async def list_models(state: StateDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_object(state)]}

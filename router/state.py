"""What a router process builds once at startup and every handler reads (app.state.router)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request
from redis.commands.core import AsyncScript

from router.placement.place import Placer
from router.pool_view.model_catalog import ModelCatalog
from router.relay.dispatch import Dispatcher
from shared.block_hash import BlockHasher
from shared.config import Settings


@dataclass
class RouterState:
    settings: Settings
    model_dir: Path
    model_id: str
    catalog: ModelCatalog  # every model the pool serves
    dispatcher: Dispatcher
    aredis: aioredis.Redis
    pool_script: AsyncScript
    queue_key: str
    # `created` of the model object: the model directory's mtime, read once at startup.
    model_created: int
    # The prompt cache's block hashing, for routing (shared.block_hash).
    hasher: BlockHasher
    placer: Placer  # where each admitted prompt goes (router.placement.place)


async def get_state(request: Request) -> RouterState:
    """FastAPI dependency (async: FastAPI runs a plain function's in a worker thread, a trip of
    two context switches a request)."""
    return request.app.state.router


# Handler parameter type: `state: StateDep`.
StateDep = Annotated[RouterState, Depends(get_state)]

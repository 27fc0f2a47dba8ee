"""The router's FastAPI app: `create_app(settings)` and the lifespan that builds everything once.

Importing this module imports prometheus_client: in multiprocess mode PROMETHEUS_MULTIPROC_DIR
must already be set (router.serve does it).

`create_app()` with no argument reads the settings a parent `router.serve` left in the
environment (so CLI overrides reach every uvicorn worker process), else `load_settings()`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import redis
from fastapi import FastAPI

from router.admission.admit import AdmissionContext
from router.admission.tokenization import load_tokenizer
from router.edge import server_tick
from router.edge.auth import install_auth, load_access
from router.edge.body_limit import BodyLimit
from router.edge.busy_gate import BusyGateMiddleware
from router.edge.errors import install_error_handlers
from router.edge.http_metrics import HttpMetrics
from router.metrics import init_labels
from router.placement.ledger import AdmissionLedger
from router.placement.place import Placer
from router.pool_view.cache_stats import register_pool_script
from router.pool_view.model_catalog import ModelCatalog
from router.redis_batch import RedisBatch
from router.relay.dispatch import Dispatcher, build_queue
from router.relay.stream_hub import StreamHub
from router.routes import (
    cache,
    chat,
    completions,
    embeddings,
    health,
    messages,
    metrics,
    models,
    responses,
    tokenize,
)
from router.serve import SETTINGS_ENV
from router.state import RouterState
from shared.block_hash import BlockHasher, canary
from shared.canary_check import check_against_workers
from shared.config import Settings, load_settings
from shared.gc_freeze import freeze_startup_heap, space_young_passes
from shared.model_facts import configured_model_dir, model_id_for
from shared.redis_auth import masked_url
from shared.redis_clients import async_client, sync_client

log = logging.getLogger(__name__)


def settings_from_env() -> Settings:
    raw = os.environ.get(SETTINGS_ENV)
    return Settings.model_validate_json(raw) if raw else load_settings()


def model_dir_for(settings: Settings) -> Path:
    return configured_model_dir(settings.model.path, settings.cache_dir)


# How long a starting router process waits for Redis to answer before it gives up.
STARTUP_REDIS_WAIT_S = 60.0


async def _until_redis_answers(settings: Settings, check: Callable[[], Awaitable[None]]) -> None:
    """Run `check` (idempotent Redis reads and writes) until Redis answers it, retrying a lost
    connection or a timeout for up to STARTUP_REDIS_WAIT_S; any other error at once."""
    deadline = time.monotonic() + STARTUP_REDIS_WAIT_S
    delay = 0.2
    while True:
        try:
            await check()
            return
        except redis.AuthenticationError:
            raise
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning(
                "Redis at %s does not answer yet (%s); retrying",
                masked_url(settings.redis.url),
                exc,
            )
            await anyio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def _build_state(settings: Settings) -> RouterState:
    if not settings.redis.url:
        raise RuntimeError("the router needs a Redis URL (REDIS_URL or [redis] url)")
    model_dir = model_dir_for(settings)
    # Loading a tokenizer reads files and builds Rust objects: keep it off the event loop.
    tokenizer = await anyio.to_thread.run_sync(
        load_tokenizer, model_dir, settings.router.tokenizer_copies
    )
    model_id = model_id_for(model_dir, settings.model.id)
    aredis = async_client(settings.redis)
    sync_redis = sync_client(settings.redis)
    pc = settings.prompt_cache
    hasher = BlockHasher(pc.apc_block_size, pc.apc_hash)
    mine = canary(tokenizer.hf, model_id, hasher)
    try:
        # Redis must answer (a wrong password fails at once); a stall or a restart while this
        # process starts is waited out, as a running router waits it out: uvicorn stops every
        # process of the router when one fails its startup.
        await _until_redis_answers(
            settings,
            lambda: anyio.to_thread.run_sync(check_against_workers, sync_redis, model_id, mine),
        )
    except redis.RedisError as exc:
        await aredis.aclose()
        sync_redis.close()
        shown = masked_url(settings.redis.url)  # the error is logged: never the password
        raise RuntimeError(f"cannot reach Redis at {shown}: {exc}") from exc
    queue = build_queue(sync_redis, model_id)
    batch = RedisBatch(aredis)
    hub = StreamHub(settings.redis, batch)
    await hub.start()
    ledger = AdmissionLedger(
        settings.admission, settings.routing, settings.prompt_cache, sync_redis, aredis, batch
    )
    await ledger.start()
    dispatcher = Dispatcher(
        sync_redis=sync_redis,
        aredis=aredis,
        hub=hub,
        job_timeout_s=settings.worker.job_timeout_s,
        request_timeout_s=settings.router.request_timeout_s,
        ledger=ledger,
        batch=batch,
    )
    try:
        await anyio.to_thread.run_sync(dispatcher.warm_rq)
    except redis.RedisError as exc:  # the first enqueue reads it (once, on the event loop)
        log.warning("could not read the Redis server's version for rq: %s", exc)
    admission = AdmissionContext(
        model_id,
        tokenizer,
        settings.worker.default_max_tokens,
        settings.router.trust_request_chat_template,
    )
    created = int(model_dir.stat().st_mtime)
    return RouterState(
        settings=settings,
        model_dir=model_dir,
        model_id=model_id,
        catalog=ModelCatalog(
            admission, created, sync_redis, hasher, settings.router.tokenizer_copies, batch
        ),
        dispatcher=dispatcher,
        aredis=aredis,
        pool_script=register_pool_script(aredis),
        queue_key=queue.key,
        model_created=created,
        hasher=hasher,
        placer=Placer(ledger, hasher, model_id, settings.admission.retry_after_s),
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    state = await _build_state(settings)
    init_labels(state.model_id)
    app.state.router = state
    await state.catalog.start()
    freeze_startup_heap(log)
    space_young_passes()
    log.info(
        "router ready: model %r from %s, routing %s, redis %s",
        state.model_id,
        state.model_dir,
        settings.routing.policy,
        masked_url(settings.redis.url),
    )
    log.info("%s", app.state.access.describe())
    try:
        yield
    finally:
        await state.catalog.stop()
        await state.dispatcher.ledger.stop()
        await state.dispatcher.hub.stop()
        await state.dispatcher.batch.stop()
        await state.aredis.aclose()
        state.dispatcher.sync_redis.close()


def create_app(settings: Settings | None = None) -> FastAPI:
    server_tick.install()  # uvicorn's Server of this process (the factory runs in each)
    app = FastAPI(title="mlxcel-pool router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings if settings is not None else settings_from_env()
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=app.state.settings.router.max_body_bytes)
    # Inside auth, outside everything that reads a body: a flood's refusals cost no parsing.
    app.add_middleware(BusyGateMiddleware)
    # Added after them, so it runs before them: an unauthenticated request is refused before
    # anything reads it.
    install_auth(app, load_access(app.state.settings.auth))
    routes = (
        completions,
        chat,
        responses,
        messages,
        embeddings,
        models,
        health,
        cache,
        metrics,
        tokenize,
    )
    for module in routes:
        app.include_router(module.router)
    # Outermost (added last): every response counted, the door's refusals too.
    paths = frozenset(p for r in app.routes if (p := getattr(r, "path", "")))
    app.add_middleware(HttpMetrics, paths=paths)
    return app

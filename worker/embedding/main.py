"""An embedding worker's start: load the model once, register its model with the pool (the same
presence as a generation worker's, its info hash saying `task = embedding`), run its loop.

worker.main.run hands over to `run` here when the model's config.json marks an embedding model
(worker/embedding/task.py).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from shared.canary_check import CanaryMismatch, check_against_routers
from shared.config import EXIT_CONFIG, Settings
from shared.embedding_wire import TASK_EMBEDDING
from shared.model_facts import ModelConfigError
from shared.redis_auth import masked_url
from worker.embedding.task import EmbeddingConfigError, EmbeddingTask

if TYPE_CHECKING:  # the loop imports mlx, which must wait for the OpenBLAS preload
    from worker.embedding.loop import EmbeddingLoop

log = logging.getLogger("mlxcel.worker.embedding")


def run(settings: Settings, model_dir: Path, task: EmbeddingTask) -> int:
    from worker.model_dir import ModelDirError

    try:
        loop = build_embedding_worker(settings, model_dir, task)
    except (CanaryMismatch, ModelDirError, ModelConfigError, EmbeddingConfigError) as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    if loop is None:
        return EXIT_CONFIG
    from worker.serve import serve

    return serve(loop, log)


def build_embedding_worker(
    settings: Settings, model_dir: Path, task: EmbeddingTask
) -> EmbeddingLoop | None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from worker.mlx_cpu import blas

    blas.preload_openblas()  # first: nothing may import mlx before OpenBLAS is loaded
    from shared.model_facts import model_facts
    from shared.redis_clients import sync_client
    from worker import model_dir as model_dir_check
    from worker.broker.intake import own_queues
    from worker.broker.presence import WorkerPresence
    from worker.broker.publisher import Publisher
    from worker.broker.reaper import Reaper
    from worker.embedding.intake import EmbeddingIntake
    from worker.embedding.loop import EmbeddingLoop
    from worker.embedding.model import EmbeddingModel
    from worker.main import resolve_worker_id, routing_canary

    blas.report(log)
    if not settings.redis.url:
        log.error("REDIS_URL is not set: the worker needs the pool's Redis")
        return None
    worker_id = resolve_worker_id(settings)
    model_config = model_dir_check.check_before_load(model_dir)
    facts = model_facts(model_dir, settings.model.id)
    t0 = time.perf_counter()
    model, tokenizer = model_dir_check.load(model_dir, model_config)
    log.info(
        "worker %s loaded embedding model %s from %s in %.1fs",
        worker_id,
        facts.model_id,
        model_dir,
        time.perf_counter() - t0,
    )
    vocab_size = facts.vocab_size or int(model.args.vocab_size)
    model_dir_check.check_tokenizer(model_dir, tokenizer, vocab_size)
    embedder = EmbeddingModel(model, task.pooling, 0)
    # One token through the backbone: it runs, and its width is the vectors' size.
    dimensions = embedder.dimensions = int(embedder.embed([[0]]).shape[1])
    conn = sync_client(settings.redis, report_failover=True)
    # The router tokenizes string inputs with the model's tokenizer, checked as for generation.
    my_canary = routing_canary(tokenizer, facts.model_id, settings)
    check_against_routers(conn, facts.model_id, my_canary)
    info = {
        "worker_id": worker_id,
        "model": facts.model_id,
        "task": TASK_EMBEDDING,
        "embedding_dimensions": str(dimensions),
        "pooling": task.pooling.value,
        "pid": str(os.getpid()),
        "host": socket.gethostname(),
        "started_at": f"{time.time():.3f}",
        "batch_size": str(settings.worker.batch_size),
        "batch_limit": str(settings.worker.batch_size),
        "canary": my_canary,
        "model_dir": str(model_dir.resolve()),
    }
    presence = WorkerPresence(
        conn,
        worker_id,
        own_queues(conn, worker_id, facts.model_id),
        info,
        stuck_after_s=settings.worker.stuck_after_s,
    )
    intake = EmbeddingIntake(presence)
    banner = (
        f"embedding model {facts.model_id} ({dimensions} dimensions, {task.pooling.value} "
        f"pooling), redis {masked_url(settings.redis.url)}"
    )
    return EmbeddingLoop(
        model=embedder,
        presence=presence,
        intake=intake,
        publisher=Publisher(presence, intake),
        reaper=Reaper(presence, intake),
        vocab_size=vocab_size,
        context_length=facts.context_length,
        max_jobs=settings.worker.batch_size,
        static_gauges={"enabled": "0", "storage_mode": "none"},
        banner=banner,
    )

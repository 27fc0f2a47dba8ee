"""`mlxcel-pool worker`: load the model once, check its cache, register with rq, run the loop."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.block_hash import BlockHasher, canary
from shared.canary_check import CanaryMismatch, check_against_routers
from shared.config import EXIT_CONFIG, Settings
from shared.model_facts import ModelConfigError, configured_model_dir
from shared.redis_auth import masked_url

if TYPE_CHECKING:
    from worker.engine.batch_invariance import BatchInvariance
    from worker.loop import WorkerLoop
    from worker.prompt_cache.policy import PromptCache

log = logging.getLogger("mlxcel.worker")


def resolve_worker_id(settings: Settings) -> str:
    return settings.worker.id or f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def run(settings: Settings) -> int:
    from worker.embedding.task import EmbeddingConfigError, embedding_task
    from worker.model_dir import ModelDirError

    # An embedding model's worker runs its own loop (worker/embedding/); the directory is read
    # as configured, never built here (building imports mlx before the OpenBLAS preload).
    configured = configured_model_dir(settings.model.path, settings.cache_dir)
    try:
        task = embedding_task(configured)
    except EmbeddingConfigError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    if task is not None:
        from worker.embedding.main import run as run_embedding

        return run_embedding(settings, configured, task)
    try:
        loop = build_worker(settings)
    except (CanaryMismatch, ModelDirError, ModelConfigError) as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    if loop is None:
        return EXIT_CONFIG
    from worker.serve import serve

    return serve(loop, log)


def build_worker(settings: Settings) -> WorkerLoop | None:
    """Everything but the loop's run: model, cache check, prompt cache, engine, the Redis side."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from worker.mlx_cpu import blas

    blas.preload_openblas()  # first: nothing may import mlx before OpenBLAS is loaded
    from shared.model_facts import model_facts
    from shared.redis_clients import sync_client
    from worker import model_dir as model_dir_check
    from worker.broker.intake import RqIntake, own_queues
    from worker.broker.outbox import Outbox
    from worker.broker.peer_queues import PeerQueues
    from worker.broker.presence import WorkerPresence
    from worker.broker.publisher import Publisher
    from worker.broker.reaper import Reaper
    from worker.engine.engine import Engine
    from worker.loop import WorkerLoop
    from worker.mlx_cpu import gemv_turn

    blas_info = blas.report(log, turn_measured=gemv_turn.will_measure())
    if not settings.redis.url:
        log.error("REDIS_URL is not set: the worker needs the pool's Redis")
        return None
    worker_id = resolve_worker_id(settings)
    model_dir = _model_dir(settings)
    model_config = model_dir_check.check_before_load(model_dir)
    facts = model_facts(model_dir, settings.model.id)
    model, tokenizer = _load(model_dir, model_config, facts.model_id, worker_id)
    vocab_size = facts.vocab_size or int(model.args.vocab_size)
    model_dir_check.check_tokenizer(model_dir, tokenizer, vocab_size)
    from worker import model_fixes

    model_fixes.install(model)  # mlx-lm classes that are wrong in a batch (Gemma 2's mask)
    if settings.worker.cpu_fast_ops:
        from worker.mlx_cpu import cpu_ops

        cpu_ops.install(model)
    # Before the batch-invariance check: which products go to gemv changes a batch's numbers.
    gemv_rows = _gemv_turn(settings, model, model_dir, blas_info, worker_id)
    batching = _batch_invariance(settings, model, vocab_size, worker_id)
    configured_batch = settings.worker.batch_size
    settings = _served_at(settings, batching)
    prompt_cache, settings_gauges = _prompt_cache(settings, model, facts.model_id, worker_id)
    # A Sentinel failover reaches the loop as a lost connection: it drops what runs (the new
    # primary may lack their last writes) and registers again, as after a restart.
    conn = sync_client(settings.redis, report_failover=True)
    my_canary = routing_canary(tokenizer, facts.model_id, settings)
    check_against_routers(conn, facts.model_id, my_canary)
    info = {
        "worker_id": worker_id,
        "model": facts.model_id,
        "pid": str(os.getpid()),
        "host": socket.gethostname(),
        "started_at": f"{time.time():.3f}",
        "batch_size": str(configured_batch),
        "batch_invariant": batching.flag,
        "batch_limit": str(settings.worker.batch_size),
        "storage_modes": settings_gauges.pop("storage_modes"),
        "canary": my_canary,
        "model_dir": str(model_dir.resolve()),
        "gemv_rows": str(gemv_rows),
    }
    presence = WorkerPresence(
        conn,
        worker_id,
        own_queues(conn, worker_id, facts.model_id),
        info,
        stuck_after_s=settings.worker.stuck_after_s,
    )
    intake = RqIntake(presence)
    engine = Engine(
        model,
        tokenizer,
        settings.worker,
        model_id=facts.model_id,
        worker_id=worker_id,
        context_length=facts.context_length,
        prompt_cache=prompt_cache,
    )
    publisher = Publisher(presence, intake)
    return WorkerLoop(
        engine=engine,
        presence=presence,
        intake=intake,
        publisher=publisher,
        outbox=Outbox(publisher),
        reaper=Reaper(presence, intake),
        static_gauges=settings_gauges,
        admission_window_s=settings.worker.admission_window_ms / 1000,
        banner=_banner(facts.model_id, blas_info, settings_gauges, settings, batching),
        peers=PeerQueues(conn, worker_id, facts.model_id, settings.routing.steal_after_ms / 1000),
    )


def _banner(
    model_id: str,
    blas_info: Any,
    gauges: dict[str, Any],
    settings: Settings,
    batching: BatchInvariance,
) -> str:
    """One line saying what this worker runs: model, BLAS and its speed, cache mode, the batch
    size it serves at and whether batching was found to change tokens, Redis."""
    gflops = f" {blas_info.gflops:.0f} GFLOPS" if getattr(blas_info, "gflops", None) else ""
    cache = gauges.get("storage_mode") or "off"
    return (
        f"model {model_id}, BLAS {blas_info.backend}{gflops}, prompt cache {cache} "
        f"({gauges.get('cacheability') or '-'}), batch {settings.worker.batch_size} "
        f"({batching.summary}), redis {masked_url(settings.redis.url)}"
    )


def routing_canary(tokenizer: Any, model_id: str, settings: Settings) -> str:
    pc = settings.prompt_cache
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the HF tokenizer
    return canary(hf, model_id, BlockHasher(pc.apc_block_size, pc.apc_hash))


def _model_dir(settings: Settings) -> Path:
    model_dir = configured_model_dir(settings.model.path, settings.cache_dir)
    if settings.model.path:
        return model_dir
    if not model_dir.exists():
        from devmodel.builder import ensure_model

        model_dir = ensure_model(settings.cache_dir)
    return model_dir


def _load(
    model_dir: Path, model_config: dict[str, Any], model_id: str, worker_id: str
) -> tuple[Any, Any]:
    from worker.model_dir import load

    t0 = time.perf_counter()
    model, tokenizer = load(model_dir, model_config)
    log.info(
        "worker %s loaded model %s from %s in %.1fs",
        worker_id,
        model_id,
        model_dir,
        time.perf_counter() - t0,
    )
    return model, tokenizer


def _gemv_turn(
    settings: Settings, model: Any, model_dir: Path, blas_info: Any, worker_id: str
) -> int:
    """The rows a product may have to go to gemv: `MLXCEL_GEMV_ROWS` when set to a count, else
    this host's measured turn (worker/mlx_cpu/gemv_turn.py); 0 when the interposer is off."""
    from worker.mlx_cpu import gemv_turn

    if not gemv_turn.will_measure():
        return int(blas_info.gemv_rows)
    turn = gemv_turn.resolve(model, blas_info.path, model_dir, settings.cache_dir)
    measured = ", ".join(f"{n} rows {r:.2f}" for n, r in sorted(turn.ratios.items()))
    log.info(
        "worker %s gemv turn: products of up to %d row%s go to gemv (%s; gemv/gemm step time: %s)",
        worker_id,
        turn.rows,
        "" if turn.rows == 1 else "s",
        {"probe": f"measured in {turn.seconds:.2f}s, kept", "cache": "kept earlier"}.get(
            turn.source, "the probe failed"
        ),
        measured or "-",
    )
    return turn.rows


def _batch_invariance(
    settings: Settings, model: Any, vocab_size: int, worker_id: str
) -> BatchInvariance:
    """The load-time batch-invariance check (worker/engine/batch_invariance.py), or its
    unchecked verdict when `worker.batch_invariance_check` is off."""
    from worker.engine.batch_invariance import BatchInvariance, check_batch_invariance

    w = settings.worker
    if not w.batch_invariance_check:
        log.info("batch invariance: not checked (worker.batch_invariance_check is off)")
        return BatchInvariance(w.batch_size, None, configured=w.batch_size)
    verdict = check_batch_invariance(model, w, vocab_size)
    log.info(
        "worker %s batch invariance: %s; serving at batch size %d of %d (checked in %.2fs)",
        worker_id,
        verdict.reason,
        verdict.limit,
        w.batch_size,
        verdict.seconds,
    )
    return verdict


def _served_at(settings: Settings, batching: BatchInvariance) -> Settings:
    """The settings with the worker's batch and prefill batch sizes capped at what it serves."""
    from worker.engine.batch_invariance import capped

    worker = capped(settings.worker, batching)
    return settings if worker is settings.worker else settings.model_copy(update={"worker": worker})


def _prompt_cache(
    settings: Settings, model: Any, model_id: str, worker_id: str
) -> tuple[PromptCache | None, dict[str, Any]]:
    """The load-time cacheability check decides the storage mode (or no cache at all); returns
    the cache and the settings and limits the worker reports beside its gauges."""
    from worker.prompt_cache.cacheability import check_model, resolve_storage_mode
    from worker.prompt_cache.policy import PromptCache

    pc = settings.prompt_cache
    cacheability = check_model(model)
    storage = resolve_storage_mode(pc.storage, settings.worker.batch_size, cacheability)
    log.info(
        "prompt cache: model cache is %s (%s); storage mode %s; cache %s",
        cacheability.kind,
        cacheability.reason,
        storage,
        "enabled" if pc.enabled else "disabled",
    )
    cache = None
    if storage != "none":
        cache = PromptCache(pc, model_id=model_id, storage_mode=storage, worker_id=worker_id)
    reported = {
        "enabled": "1" if (pc.enabled and cache is not None) else "0",
        "apc_enabled": "1" if pc.apc_enabled else "0",
        "block_size": pc.apc_block_size,
        "hash": pc.apc_hash,
        "paged_block_size": 0,
        "storage_mode": storage,
        "cacheability": cacheability.kind,
        "storage_modes": ",".join(cacheability.storage_modes),
        "capacity_bytes": pc.capacity_bytes,
        "max_entries": pc.max_entries,
        "snapshot_capacity_bytes": pc.snapshot_capacity_bytes,
        "snapshot_max_entries": pc.snapshot_max_entries,
    }
    return cache, reported

"""The load-time batch-invariance check: the tiny model passes at its configured batch size; a
model whose logits depend on the batch is served at the largest size that still matches (1 when
even two differ); a real worker reports the verdict in its info hash, the router's pool read
(`/health`, `/v1/cache/stats`) and its ready line."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import redis
import redis.asyncio as aioredis

from router.pool_view.cache_stats import read_pool, register_pool_script
from shared import keys
from shared.cache_stats import merge_pool
from shared.config import WorkerConfig
from tests.test_model_zoo import cpu_ops_installed
from worker.engine.batch_invariance import (
    UNCHECKED,
    BatchInvariance,
    capped,
    check_batch_invariance,
    check_prompts,
    generate,
)

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path) -> Iterator[Any]:
    """The tiny model as a worker runs it (with the CPU ops installed, and put back after the
    module: they replace functions of mlx-lm's model modules, which other tests check)."""
    from mlx_lm import load

    model, _ = load(str(tiny_model_dir))
    with pytest.MonkeyPatch.context() as mp:
        cpu_ops_installed(mp, model)
        yield model


class BatchSkewed:
    """A model wrapper whose logits get noise whenever more than `above` sequences run together:
    a model whose batched path is broken."""

    def __init__(self, model: Any, above: int) -> None:
        self._model = model
        self._above = above

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        logits = self._model(inputs, cache=cache, **kwargs)
        if inputs.shape[0] > self._above:
            noise = mx.random.normal(logits.shape, key=mx.random.key(7)) * 100
            logits = logits + noise.astype(logits.dtype)
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_tiny_model_passes_at_the_configured_size(tiny_model: Any) -> None:
    config = WorkerConfig(batch_size=8)
    verdict = check_batch_invariance(tiny_model, config, 1024)
    assert (verdict.limit, verdict.invariant, verdict.flag) == (8, True, "1")
    assert verdict.sizes_checked == (2, 8)
    assert capped(config, verdict) is config


def test_batched_tokens_equal_solo_tokens(tiny_model: Any) -> None:
    prompts = check_prompts(1024)
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths: left padding
    solo = [generate(tiny_model, [p], WorkerConfig(), 1)[0] for p in prompts]
    assert generate(tiny_model, prompts, WorkerConfig(), 4) == solo
    assert all(len(t) == 6 for t in solo)


def test_broken_batching_is_served_at_one(tiny_model: Any) -> None:
    config = WorkerConfig(batch_size=32, prefill_batch_size=8)
    verdict = check_batch_invariance(BatchSkewed(tiny_model, above=1), config, 1024)
    assert (verdict.limit, verdict.invariant, verdict.flag) == (1, False, "0")
    assert verdict.sizes_checked == (2,)  # nothing larger is tried once 2 differs
    served = capped(config, verdict)
    assert (served.batch_size, served.prefill_batch_size) == (1, 1)
    assert "capped from 32" in verdict.summary


def test_batching_broken_above_four_is_served_at_four(tiny_model: Any) -> None:
    config = WorkerConfig(batch_size=16, prefill_batch_size=8)
    verdict = check_batch_invariance(BatchSkewed(tiny_model, above=4), config, 1024)
    assert (verdict.limit, verdict.invariant) == (4, False)
    assert verdict.sizes_checked == (2, 16, 8, 4)
    assert verdict.reason.endswith("differ from solo ones at batch size 8, equal at 4")
    served = capped(config, verdict)
    assert (served.batch_size, served.prefill_batch_size) == (4, 4)


class RaisesInBatches(BatchSkewed):
    """A model whose batched path raises past `above` sequences (as mlx-lm's Gemma 2 mask did
    for three and more)."""

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if inputs.shape[0] > self._above:
            raise ValueError("shapes cannot be broadcast")
        return self._model(inputs, cache=cache, **kwargs)


def test_a_batch_that_raises_counts_as_differing(tiny_model: Any) -> None:
    config = WorkerConfig(batch_size=8)
    verdict = check_batch_invariance(RaisesInBatches(tiny_model, above=2), config, 1024)
    assert (verdict.limit, verdict.flag, verdict.sizes_checked) == (2, "0", (2, 8, 4))


def test_batch_size_one_needs_no_check() -> None:
    verdict = check_batch_invariance(object(), WorkerConfig(batch_size=1), 1024)
    assert (verdict.limit, verdict.flag, verdict.sizes_checked) == (1, "1", ())


def test_unchecked_verdict_keeps_the_configured_size() -> None:
    config = WorkerConfig(batch_size=12)
    verdict = BatchInvariance(12, None, configured=12)
    assert verdict.flag == UNCHECKED
    assert capped(config, verdict) is config


def _pool_view(redis_url: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The router's one-script read of the pool: what `/health` spreads into its per-worker
    entry (the snapshot's info), and `/v1/cache/stats`'s per-worker breakdown."""

    async def read() -> tuple[dict[str, str], dict[str, Any]]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            (snap,) = await read_pool(register_pool_script(client))
            return snap.info, merge_pool([snap])["workers"][snap.worker_id]
        finally:
            await client.aclose()

    return asyncio.run(read())


def test_worker_reports_the_verdict(redis_url: str, start_worker: Any) -> None:
    w = start_worker(redis_url, "bi1", env={"MLXCEL_BATCH_SIZE": "8"})
    info = redis.Redis.from_url(redis_url, decode_responses=True).hgetall(keys.worker_info("bi1"))
    assert (info["batch_invariant"], info["batch_limit"], info["batch_size"]) == ("1", "8", "8")
    health_info, stats = _pool_view(redis_url)
    assert (health_info["batch_invariant"], health_info["batch_limit"]) == ("1", "8")
    assert (stats["batch_invariant"], stats["batch_limit"]) == ("1", 8)
    log = w.log()
    assert "batch invariance: batched greedy tokens equal solo ones" in log
    assert "batch 8 (batch-invariant)" in log


def test_worker_with_the_check_off_says_unchecked(redis_url: str, start_worker: Any) -> None:
    start_worker(redis_url, "bi2", env={"MLXCEL_BATCH_INVARIANCE_CHECK": "false"})
    info = redis.Redis.from_url(redis_url, decode_responses=True).hgetall(keys.worker_info("bi2"))
    assert (info["batch_invariant"], info["batch_limit"]) == (UNCHECKED, info["batch_size"])

"""worker.mlx_cpu.gemv_turn: the rows a product may have to go to gemv, measured once per host
and model in whole decode steps of the real model, kept, and read back by later starts.

Which turn a host gets is its own timing, so no test names one: they check the rule that turns
ratios into rows, that the turn measured is the turn applied and kept, that a later start (or
one waiting on the first) reads it instead of measuring, and that a worker says it in its info
hash. The suite itself runs with MLXCEL_GEMV_ROWS pinned (conftest): these tests set `auto`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from router.pool_view.cache_stats import read_pool, register_pool_script
from shared import keys
from shared.cache_stats import merge_pool
from worker.mlx_cpu import blas, gemv_turn, sgemm_rows

REPO = Path(__file__).resolve().parents[1]

needs_openblas = pytest.mark.skipif(sys.platform == "darwin", reason="macOS uses Accelerate")


@pytest.mark.parametrize(
    ("ratios", "rows"),
    [
        ({}, 1),  # nothing measured: one row, which gemv wins on every machine measured
        ({2: 0.80, 3: 0.90, 4: 0.96, 5: 1.05}, 4),
        ({2: 0.80, 3: 0.98}, 2),  # within the margin is no win
        ({2: 1.20}, 1),
        ({2: 0.80, 4: 0.80}, 2),  # a count not measured ends the run
        ({2: 0.5, 3: 0.5, 4: 0.5, 5: 0.5, 6: 0.5, 7: 0.5, 8: 0.5}, 8),
    ],
)
def test_one_row_always_then_each_count_while_gemv_wins_it_by_the_margin(
    ratios: dict[int, float], rows: int
) -> None:
    assert gemv_turn.turn_from(ratios) == rows


def _gemv_count(rows: int) -> int:
    """How many products a `rows`-row matmul sent to gemv."""
    x = mx.array(np.ones((rows, 64), dtype=np.float32))
    w = mx.array(np.ones((64, 48), dtype=np.float32))
    before = sgemm_rows.gemv_products()
    mx.eval(x @ w)
    return sgemm_rows.gemv_products() - before


@needs_openblas
def test_set_rows_moves_products_between_gemv_and_gemm_at_once() -> None:
    assert sgemm_rows.loaded()
    try:
        assert sgemm_rows.set_rows(3)
        assert [_gemv_count(n) for n in (1, 3, 4, 8)] == [1, 1, 0, 0]
        sgemm_rows.set_rows(0)
        assert [_gemv_count(n) for n in (1, 3)] == [0, 0]
    finally:
        sgemm_rows.set_rows(sgemm_rows.configured_rows())


def test_the_key_changes_with_the_model_and_the_blas_threads(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * 64}))
    key = gemv_turn.host_key("/x/libopenblas.so.0", tiny_model_dir)
    assert key == gemv_turn.host_key("/x/libopenblas.so.0", tiny_model_dir)
    assert key != gemv_turn.host_key("/x/libopenblas.so.0", other)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert key != gemv_turn.host_key("/x/libopenblas.so.0", tiny_model_dir)


# One start of a worker's measurement, in its own process as a worker does it: the tiny model
# loaded with the worker's CPU ops, then resolve(); prints what it found and what it applied.
RESOLVE = """
import json, sys
from pathlib import Path
from worker.mlx_cpu import blas, gemv_turn, sgemm_rows
info = blas.preload_openblas()
import mlx.core as mx
import numpy as np
from mlx_lm import load
from worker.mlx_cpu import cpu_ops
model, _ = load(sys.argv[1])
cpu_ops.install(model)
turn = gemv_turn.resolve(model, info.path, Path(sys.argv[1]), Path(sys.argv[2]))
def gemv(rows):
    before = sgemm_rows.gemv_products()
    mx.eval(mx.ones((rows, 64)) @ mx.ones((64, 48)))
    return sgemm_rows.gemv_products() - before
print(json.dumps({"rows": turn.rows, "source": turn.source, "key": turn.key,
                  "ratios": turn.ratios, "at": gemv(turn.rows), "past": gemv(turn.rows + 1)}))
"""


def _resolve(model_dir: Path, cache: Path) -> subprocess.Popen[str]:
    env = {**os.environ, sgemm_rows.ROWS_ENV: "auto", "MLXCEL_CACHE_DIR": str(cache)}
    return subprocess.Popen(
        [sys.executable, "-c", RESOLVE, str(model_dir), str(cache)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


@needs_openblas
def test_a_host_measures_once_and_later_starts_read_its_turn(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    first = _result(_resolve(tiny_model_dir, tmp_path))
    assert first["source"] == "probe"
    assert 1 <= first["rows"] <= gemv_turn.MAX_ROWS  # type: ignore[operator]
    assert first["ratios"], "the probe measured no row count"
    # The turn measured is the one applied: its count goes to gemv, one more to gemm.
    assert (first["at"], first["past"]) == (1, 0)
    kept = json.loads((tmp_path / "gemv_turn" / f"{first['key']}.json").read_text())
    assert kept["rows"] == first["rows"]

    second = _result(_resolve(tiny_model_dir, tmp_path))
    assert second["source"] == "cache"
    assert (second["rows"], second["key"]) == (first["rows"], first["key"])
    assert (second["at"], second["past"]) == (1, 0)


@needs_openblas
def test_workers_starting_together_on_a_host_measure_once(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    procs = [_resolve(tiny_model_dir, tmp_path) for _ in range(2)]
    results = [_result(p) for p in procs]
    assert sorted(r["source"] for r in results) == ["cache", "probe"]  # type: ignore[type-var]
    assert results[0]["rows"] == results[1]["rows"]
    assert len(list((tmp_path / "gemv_turn").glob("*.json"))) == 1


@needs_openblas
def test_an_unreadable_kept_turn_is_measured_again(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = _result(_resolve(tiny_model_dir, tmp_path))
    (tmp_path / "gemv_turn" / f"{first['key']}.json").write_text("{not json")
    again = _result(_resolve(tiny_model_dir, tmp_path))
    assert again["source"] == "probe"
    kept = json.loads((tmp_path / "gemv_turn" / f"{first['key']}.json").read_text())
    assert kept["rows"] == again["rows"]


@needs_openblas
def test_a_worker_measures_its_turn_and_says_it_in_its_info_hash(
    redis_url: str, start_worker, tmp_path: Path, tiny_model_dir: Path
) -> None:
    cache = tmp_path / "cache"
    measured = start_worker(
        redis_url, "wauto", env={sgemm_rows.ROWS_ENV: "auto", "MLXCEL_CACHE_DIR": str(cache)}
    )
    kept = [json.loads(p.read_text()) for p in (cache / "gemv_turn").glob("*.json")]
    assert len(kept) == 1
    r = redis.Redis.from_url(redis_url)
    assert r.hget(keys.worker_info("wauto"), "gemv_rows") == str(kept[0]["rows"]).encode()
    assert "gemv turn: products of up to" in measured.log()
    health_info, stats = _pool_view(redis_url, "wauto")
    assert (health_info["gemv_rows"], stats["gemv_rows"]) == (str(kept[0]["rows"]), kept[0]["rows"])

    # A count set by the operator is used as it is: nothing measured, nothing kept.
    shutil.rmtree(cache / "gemv_turn")
    start_worker(redis_url, "wset", env={sgemm_rows.ROWS_ENV: "3", "MLXCEL_CACHE_DIR": str(cache)})
    assert r.hget(keys.worker_info("wset"), "gemv_rows") == b"3"
    assert not (cache / "gemv_turn").exists()


def _pool_view(redis_url: str, worker_id: str) -> tuple[dict[str, str], dict[str, Any]]:
    """The router's read of the pool: `/health`'s per-worker info, and the worker's entry in
    `/v1/cache/stats`."""

    async def read() -> tuple[dict[str, str], dict[str, Any]]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            snaps = await read_pool(register_pool_script(client))
            (snap,) = [s for s in snaps if s.worker_id == worker_id]
            return snap.info, merge_pool([snap])["workers"][worker_id]
        finally:
            await client.aclose()

    return asyncio.run(read())


def test_the_test_process_runs_pinned() -> None:
    """conftest pins the suite's turn: every process of a test sends the same products to gemv,
    whatever this host measures."""
    assert os.environ.get(sgemm_rows.ROWS_ENV, "").strip().isdigit()
    assert not gemv_turn.wanted()
    if sys.platform != "darwin":
        assert blas.preload_openblas().gemv_rows == int(os.environ[sgemm_rows.ROWS_ENV])

"""A router on a host of its own: it needs the model's tokenizer files, and builds the built-in
model where the pool looks for it (`<cache_dir>/models/...`, as `mlxcel-pool build-model` does by
default) before uvicorn starts, in a subprocess: the router process itself never loads mlx."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from devmodel.paths import built_model_dir, is_built
from mlxcel_pool.redis_server import free_port
from shared.config import ENV_VARS
from tests.test_operator_errors import mlxcel

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent


def test_build_model_writes_where_the_pool_looks(tmp_path: Path) -> None:
    done = mlxcel("build-model", env={"MLXCEL_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(built_model_dir(tmp_path))
    assert is_built(built_model_dir(tmp_path))


def test_a_router_on_a_fresh_host_builds_the_built_in_model_without_loading_mlx(
    redis_url: str, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k not in ENV_VARS},
        "REDIS_URL": redis_url,
        "MLXCEL_CACHE_DIR": str(tmp_path / "cache"),  # nothing built there
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
    }
    argv = [sys.executable, "-m", "mlxcel_pool", "router", "--port", str(port), "--processes", "1"]
    log = tmp_path / "router.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.3)
        assert health.json()["model"] == "mlxcel-tiny-s0"  # 503 until a worker joins
        text = log.read_text()
        assert f"building the default model into {built_model_dir(tmp_path / 'cache')}" in text
        assert "Traceback" not in text
        maps = [m.path for m in psutil.Process(proc.pid).memory_maps()]
        assert [p for p in maps if "mlx" in Path(p).name.lower()] == []
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

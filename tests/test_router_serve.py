"""`python -m router` as operators run it: several uvicorn processes, settings from the
environment, and /metrics merged from the prometheus multiprocess directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxcel_pool.redis_server import free_port
from shared.reject import REJECT_REASONS

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def served(redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    port = free_port()
    multiproc = tmp_path / "prom"
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "MLXCEL_MODEL": str(tiny_model_dir),
        "MLXCEL_CACHE_DIR": str(tmp_path),
        "MLXCEL_PORT": str(port),
        "MLXCEL_ROUTER_PROCESSES": "2",
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "router"],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 40
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "router did not come up"
            try:
                if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url, multiproc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_served_router_exposes_multiprocess_metrics(served: tuple[str, Path]) -> None:
    url, multiproc = served
    resp = httpx.get(f"{url}/metrics", timeout=5)
    assert resp.status_code == 200
    assert any(multiproc.glob("*.db")), "processes write their metric files to the dir"
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    reasons = {s.labels["reason"] for s in families["mlxcel_prompt_cache_reject"].samples}
    assert reasons == {r.value for r in REJECT_REASONS}
    depth = [s for s in families["mlxcel_queue_depth"].samples]
    assert depth and depth[0].value == 0
    assert httpx.get(f"{url}/health", timeout=5).status_code == 503

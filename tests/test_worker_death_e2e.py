"""A worker killed in the middle of a stream: its client gets an error, not a 10-minute hang.

rq only marks a job whose worker vanished as failed when its registries are cleaned; the router
watches the worker's own liveness key (refreshed every second, expiring after LIVENESS_TTL_S).
Real pool: embedded Redis, router, one worker process killed with SIGKILL.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from shared import keys
from tests.pool_fixture import running_pool


def test_a_killed_worker_fails_its_streams_within_its_liveness_ttl(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    with running_pool(tiny_model_dir, tmp_path) as pool:
        health = httpx.get(f"{pool.url}/health", timeout=10).json()
        wid = health["workers"][0]["worker_id"]
        body = {"model": health["model"], "prompt": "Once upon a time", "max_tokens": 2000,
                "temperature": 0, "stream": True}  # fmt: skip
        chunks: list[dict] = []
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{pool.url}/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    break
            killed_at = time.monotonic()
            pool.kill_worker(wid)
            for line in lines:
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
            ended_after = time.monotonic() - killed_at
        error = chunks[-1].get("error")
        assert error is not None, chunks[-1]
        assert error["type"] == "server_error"
        assert f"worker {wid} stopped" in error["message"]
        # Noticed once the liveness key expired (plus the router's 1-2 s check cadence), not
        # after the 600 s request timeout.
        assert ended_after < keys.LIVENESS_TTL_S + 10
        assert not any("error" in c for c in chunks[:-1])

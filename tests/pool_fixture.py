"""A whole pool (embedded Redis, router processes, worker processes) for end-to-end tests."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from mlxcel_pool.supervisor import Pool
from shared.config import load_settings
from tests.streams import TINY_MODEL


@contextmanager
def running_pool(
    model_dir: Path,
    work_dir: Path,
    workers: int = 1,
    env: dict[str, str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> Iterator[Pool]:
    environ = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    environ.update(env or {})
    base: dict[str, dict[str, Any]] = {
        "model": {"path": str(model_dir), "cache_dir": str(work_dir)},
        "router": {"port": 0, "processes": 2},
        "metrics": {"multiproc_dir": str(work_dir / "prom")},
    }
    for section, values in (overrides or {}).items():
        base.setdefault(section, {}).update(values)
    settings = load_settings(overrides=base, environ=environ)
    pool = Pool(settings, workers=workers, extra_env=env, log_dir=work_dir / "logs")
    with pool:  # starts it
        if workers:
            pool.wait_healthy(120)
        else:
            wait_for(lambda: pool.health_status() is not None, 60, "router up")
        yield pool


def wait_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll until `predicate()` is truthy (workers publish once per step; readers poll)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def post(pool: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST `body` to the pool, for the tiny model unless the body names one."""
    return httpx.post(f"{pool.url}{path}", json={"model": TINY_MODEL, **body}, timeout=60)


def complete_tokens(
    pool: Any, prompt: list[int], max_tokens: int = 4, model: str = TINY_MODEL
) -> httpx.Response:
    """A greedy completion of a token prompt, asserted 200."""
    resp = httpx.post(
        f"{pool.url}/v1/completions",
        timeout=60,
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )
    assert resp.status_code == 200, resp.text
    return resp


def ok(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    return resp.json()


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    """Parse an SSE body into its JSON chunks (stops at [DONE])."""
    chunks = []
    for line in response.text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            break
        chunks.append(json.loads(data))
    return chunks

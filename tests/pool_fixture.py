"""A whole pool (embedded Redis, router processes, worker processes) for end-to-end tests."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from mlxcel_pool.supervisor import Pool
from shared.config import load_settings


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
        pool.wait_healthy(120)
        yield pool


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

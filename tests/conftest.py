"""Real parts only: a real redis-server per test session on a free loopback port, a real MLX model
built by the project's own builder, real processes and HTTP for the pool tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared.redis_server import EmbeddedRedis, start_redis

REPO = Path(__file__).resolve().parent.parent
# Built models are kept between runs here (ignored by git); a fresh clone builds them once.
TEST_CACHE_DIR = Path(os.environ.get("MLXCEL_TEST_CACHE_DIR", REPO / ".cache" / "test"))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """A clean database for each test."""
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    TEST_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    return TEST_CACHE_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    from worker.model_builder import ensure_model

    return ensure_model(cache_dir, "tiny")

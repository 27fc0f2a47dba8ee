"""What `up`, `router`, `worker` and `wait-redis` check before they start anything long, each
failure a ConfigError of one line naming what is wrong and the fix (the CLI exits 2 on it): that
REDIS_URL is set and answers (mlxcel_pool/redis_check.py), and that no live worker holds the ids
this host is about to use (mlxcel_pool/worker_ids.py). They only read: a host's mistake never
disturbs a pool another host runs on the same Redis."""

from __future__ import annotations

import redis

from mlxcel_pool import redis_check
from mlxcel_pool.worker_ids import holders
from shared.config import ConfigError, Settings
from shared.redis_clients import sync_client


def require_redis(settings: Settings, command: str) -> None:
    if not settings.redis.url:
        raise ConfigError(
            f"REDIS_URL is not set: `mlxcel-pool {command}` joins an existing pool "
            "(export REDIS_URL=<the pool's URL>; on the Redis host `mlxcel-pool redis-url` prints "
            "it); `mlxcel-pool up` starts one"
        )


def check_redis(settings: Settings, timeout_s: float) -> None:
    """REDIS_URL answers PING, else ConfigError with the one line saying why (waiting up to
    `timeout_s` for a Redis that does not answer yet)."""
    problem = redis_check.wait(settings.redis, timeout_s)
    if problem is not None:
        raise ConfigError(problem.message)


def check_ids_free(settings: Settings, ids: list[str], fix: str) -> None:
    """No live worker (of any host) holds one of `ids`, else ConfigError naming it; only reads."""
    client = sync_client(redis_check.probe_config(settings.redis))
    try:
        held = holders(client, ids)
    except (redis.RedisError, OSError) as exc:
        raise ConfigError(redis_check.diagnose(settings.redis.url, exc).message) from None
    finally:
        client.close()
    if held:
        raise ConfigError(held[0].message(fix))

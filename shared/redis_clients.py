"""Redis clients as the pool makes them: never a blind retry, a stall bound, a blocking pool.

- No command is retried after a timeout: Redis may already have applied it, and an XADD
  pipeline or an enqueue applied twice is what turns into duplicated text. A dropped
  connection (a restart, an idle timeout) is retried on a fresh one, a few times with a short
  backoff (redis-py's asyncio client did not do this for pipelines, so both get it here).
- The socket timeout is the stall bound (`redis.stall_timeout_s`): a Redis that answers
  nothing for that long fails the command, and the requests it carried end with a clear
  error. Every blocking read in the pool blocks for much less, so none times out early.
- The connection pool blocks: a caller past `redis.max_connections` waits for a free
  connection, up to the stall bound, instead of failing as if Redis were down.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from shared.config import RedisConfig

RETRIES = 3
CONNECT_TIMEOUT_S = 5.0
_RETRY_ON: tuple[type[Exception], ...] = (redis.ConnectionError,)


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=0.5, base=0.01)


def _options(config: RedisConfig) -> dict[str, Any]:
    return {
        "max_connections": config.max_connections,
        "timeout": config.stall_timeout_s,  # how long a caller waits for a free connection
        "socket_timeout": config.stall_timeout_s,
        "socket_connect_timeout": min(CONNECT_TIMEOUT_S, config.stall_timeout_s),
        "retry_on_error": list(_RETRY_ON),
    }


def sync_client(config: RedisConfig) -> redis.Redis:
    pool = redis.BlockingConnectionPool.from_url(
        config.url, retry=Retry(_backoff(), RETRIES, supported_errors=_RETRY_ON),
        **_options(config),
    )  # fmt: skip
    return redis.Redis(connection_pool=pool)


def async_client(config: RedisConfig) -> aioredis.Redis:
    pool = aioredis.BlockingConnectionPool.from_url(
        config.url, retry=AsyncRetry(_backoff(), RETRIES, supported_errors=_RETRY_ON),
        **_options(config),
    )  # fmt: skip
    return aioredis.Redis(connection_pool=pool)
